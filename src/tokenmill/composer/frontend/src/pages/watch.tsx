// Watch: launch the composed run, then follow it live over SSE: the current stage, time and
// throughput per stage with the bottleneck highlighted, curves, recent samples and the log.
import { useEffect, useState } from "preact/hooks";
import { api, runEvents } from "../api";
import type { Alarm, RunStatus } from "../api";
import { formatNumber, formatSeconds, LineChart, SmoothingControl } from "../components/chart";
import type { Series } from "../components/chart";
import { Inspect } from "../components/inspect";
import { Launcher } from "../components/launcher";
import { Timeline } from "../components/timeline";
import { TryPanel } from "../components/trypanel";
import { AlarmBanner, EfficiencyPanel, Startup, startupPhase } from "../components/runpanels";
import type { Row } from "../components/runpanels";
import { getPath, useStore } from "../store";

const STAGES = ["generate", "reward", "train", "critic", "sync"];
const ADVICE: Record<string, string> = {
  generate: "Generation-bound: shorten completions, lower group_size, or move generation to a faster engine / more GPUs.",
  reward: "Reward-bound: make reward functions cheaper or batched; check for slow calls near their timeout.",
  train: "Training-bound: raise micro_batch_tokens if memory allows, keep share_prompts on, or train LoRA adapters.",
  critic: "Critic-bound: a smaller or LoRA critic, or fewer critic passes.",
  sync: "Weight-sync-bound: sync only LoRA adapters, or overlap generation and training (async).",
};
const COLORS = ["#2563eb", "#16a34a", "#db2777", "#ea580c", "#7c3aed", "#0891b2"];

interface Live {
  rows: Row[]; // training steps (eval-only rows are kept apart)
  evals: Row[];
  samples: Row[];
  log: string[];
  status: RunStatus | null;
  alarms: Alarm[];
  efficiency: Row | null;
  stageSeen: boolean; // the trainer has entered a stage of its first step
  opened: number; // when this page opened the run (ms)
}
const EMPTY: Live = { rows: [], evals: [], samples: [], log: [], status: null, alarms: [], efficiency: null, stageSeen: false, opened: 0 };
// the bottleneck is judged over this many steps: one step's noise must not flip it
export const WINDOW = 10;

/** A held-out evaluation row (logged at step 0 and after the last step) rather than a training step's. */
function isEval(row: Row): boolean {
  return !("reward/mean" in row) && Object.keys(row).some((k) => k.startsWith("eval/"));
}

/** The stage with the largest share of the time of the last `window` steps. */
export function windowBottleneck(rows: Row[], window: number): { stage: string; share: number } | null {
  const recent = rows.slice(-window);
  const totals = STAGES.map((s) => recent.reduce((a, r) => a + (num(r, `timing_s/${s}`) ?? 0), 0));
  const sum = totals.reduce((a, b) => a + b, 0);
  if (sum <= 0) return null;
  const best = totals.indexOf(Math.max(...totals));
  return { stage: STAGES[best], share: totals[best] / sum };
}
const ENDED = new Set(["finished", "failed", "stopped"]);

function num(row: Row, key: string): number | null {
  const v = row[key];
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function useRun(id: string | null): Live {
  const [live, setLive] = useState<Live>(EMPTY);
  useEffect(() => {
    setLive({ ...EMPTY, opened: Date.now() });
    if (!id) return;
    // An ended run's stream sends its backlog between a first and a last `status`, then closes; the
    // browser would reconnect and replay the final status forever, so once ended, a closed stream is final.
    let ended = false;
    const close = runEvents(id, {
      metrics: (row: Row) => setLive((l) => (isEval(row) ? { ...l, evals: [...l.evals, row] } : { ...l, rows: [...l.rows, row] })),
      stage: () => setLive((l) => (l.stageSeen ? l : { ...l, stageSeen: true })),
      alarm: (a: Alarm) => setLive((l) => ({ ...l, alarms: [...l.alarms, a] })),
      efficiency: (row: Row) => setLive((l) => ({ ...l, efficiency: row })),
      samples: (row: Row) => setLive((l) => ({ ...l, samples: [...l.samples.slice(-1999), row] })),
      log: (d: { line?: string } | string) =>
        setLive((l) => ({ ...l, log: [...l.log.slice(-299), typeof d === "string" ? d : d.line ?? ""] })),
      status: (st: RunStatus) => {
        ended = ENDED.has(st.status);
        setLive((l) => ({ ...l, status: st }));
      },
      error: () => ended && close(),
    });
    return () => close();
  }, [id]);
  return live;
}

function Stages({ rows, status }: { rows: Row[]; status: RunStatus | null }) {
  const last = rows[rows.length - 1];
  const judged = windowBottleneck(rows, WINDOW);
  // timings of the last WINDOW steps decide; without timings, the trainer's own word (async: which side waits)
  const bottleneck = judged?.stage ?? (last?.bottleneck as string | undefined) ?? status?.bottleneck ?? null;
  // async runs have two sides busy at once (the producer generating while the trainer trains): mark both
  const sides = Object.entries(status?.sides ?? {});
  const current = new Map<string, string>(sides.length ? sides.map(([side, st]) => [st, side]) : status?.stage ? [[status.stage, ""]] : []);
  const used = STAGES.filter((s) => s !== "critic" || (last && `timing_s/critic` in last));
  return (
    <div class="card">
      <h2>Stages</h2>
      <div class="stages" data-testid="stages">
        {used.map((s) => {
          const share = last ? num(last, `timing_share/${s}`) : null;
          const secs = last ? num(last, `timing_s/${s}`) : null;
          const tps = last ? num(last, `throughput/${s}_tok_s`) : null;
          const cls = `stage${current.has(s) ? " current" : ""}${s === bottleneck ? " bottleneck" : ""}`;
          return (
            <div class={cls} data-testid={`stage-${s}`} data-current={String(current.has(s))} data-bottleneck={String(s === bottleneck)}>
              <div class="stage-name">
                {s}
                {current.get(s) && <span class="side muted">{current.get(s)}</span>}
                {s === bottleneck && <span class="tag">bottleneck</span>}
              </div>
              <div class="stage-bar">
                <div style={{ width: `${Math.round(100 * (share ?? 0))}%` }} />
              </div>
              <div class="stage-nums mono">
                <span>{secs === null ? "—" : formatSeconds(secs)}</span>
                <span>{share === null ? "" : `${Math.round(100 * share)}%`}</span>
                <span>{tps === null ? "" : `${Math.round(tps).toLocaleString()} tok/s`}</span>
              </div>
            </div>
          );
        })}
      </div>
      {judged && (
        <p class="muted small" data-testid="bottleneck-window">
          bottleneck over the last {Math.min(WINDOW, rows.length)} step(s): {judged.stage}, {Math.round(100 * judged.share)}% of their time
        </p>
      )}
      {bottleneck && ADVICE[bottleneck] && (
        <p class="help" data-testid="bottleneck-advice">
          {ADVICE[bottleneck]}
        </p>
      )}
    </div>
  );
}

const HIDDEN = /^(step|timing_s\/|timing_share\/|throughput\/)/;
const SHOWN_RL = new Set(["reward/mean", "kl", "entropy", "response_len/mean", "response_len/max"]);
const UNITS: Record<string, string> = { lr: "", grad_norm: "", loss: "nats", "response_len/mean": "tokens" };

/** Every numeric key of the rows, in first-seen order. */
function numericKeys(rows: Row[]): string[] {
  const keys = new Set<string>();
  rows.forEach((r) => Object.entries(r).forEach(([k, v]) => typeof v === "number" && keys.add(k)));
  return [...keys];
}

function Charts({ rows, klOff, smoothing, mode, onPick }: { rows: Row[]; klOff: boolean; smoothing: number; mode?: string;
  onPick?: (step: number) => void }) {
  const steps = rows.map((r) => num(r, "step") ?? 0);
  const col = (key: string) => rows.map((r) => num(r, key));
  const keys = numericKeys(rows);
  // RL's charts wait, empty, for a launched RL run's first step; any other run shows the keys it logs
  const rl = keys.includes("reward/mean") || (rows.length === 0 && mode === "rl");
  const perReward = keys
    .filter((k) => /^reward\/.+\/mean$/.test(k))
    .map((k, i): Series => ({ label: k.slice(7, -5), values: col(k), color: COLORS[(i + 1) % COLORS.length] }));
  const others = keys.filter((k) => !HIDDEN.test(k) && !SHOWN_RL.has(k) && !perReward.some((p) => `reward/${p.label}/mean` === k));
  const shares = STAGES.filter((s) => keys.includes(`timing_s/${s}`)).map((s, i): Series => ({
    label: s,
    values: rows.map((r) => {
      const total = STAGES.reduce((a, x) => a + (num(r, `timing_s/${x}`) ?? 0), 0);
      const t = num(r, `timing_s/${s}`);
      return t === null || total <= 0 ? null : t / total;
    }),
    color: COLORS[i % COLORS.length],
  }));
  const chart = (k: string, i: number) => (
    <LineChart title={k} testId={`chart-${k.replace(/[^A-Za-z0-9_-]/g, "_")}`} steps={steps} unit={UNITS[k]} smoothing={smoothing} onPick={onPick}
      series={[{ label: k, values: col(k), color: COLORS[i % COLORS.length] }]} />
  );
  return (
    <>
      <div class="chart-grid">
        {rl && (
          <>
            <LineChart title="Reward" testId="chart-reward" onPick={onPick} steps={steps} smoothing={smoothing} unit="score"
              series={[{ label: "total", values: col("reward/mean"), color: COLORS[0] }, ...perReward]} />
            <LineChart title="KL to reference" testId="chart-kl" onPick={onPick} steps={steps} note={klOff ? "off (kl_coef 0)" : undefined}
              smoothing={smoothing} unit="nats/token" series={[{ label: "kl", values: col("kl"), color: COLORS[4] }]} />
            <LineChart title="Entropy" testId="chart-entropy" onPick={onPick} steps={steps} smoothing={smoothing} unit="nats/token"
              series={[{ label: "entropy", values: col("entropy"), color: COLORS[2] }]} />
            <LineChart title="Response length" testId="chart-length" onPick={onPick} steps={steps} smoothing={smoothing} unit="tokens"
              series={[
                { label: "mean", values: col("response_len/mean"), color: COLORS[3] },
                { label: "max", values: col("response_len/max"), color: COLORS[5] },
              ]} />
          </>
        )}
        {!rl && others.map(chart)}
        {shares.length > 0 && (
          <LineChart title="Stage share of step time" testId="chart-stage-share" steps={steps} unit="fraction" smoothing={smoothing}
            series={shares} />
        )}
      </div>
      {rl && others.length > 0 && (
        <details class="card" data-testid="more-metrics">
          <summary>All metrics ({others.length} more)</summary>
          <div class="chart-grid">{others.map(chart)}</div>
        </details>
      )}
    </>
  );
}

export function WatchPage() {
  const s = useStore();
  const live = useRun(s.runId);
  const status = live.status;
  const klOff = s.mode === "rl" && Number(getPath(s.config, "algorithm.kl_coef") ?? 0) === 0;
  const [stopping, setStopping] = useState(false);
  const [smoothing, setSmoothing] = useState(0);
  const [picked, setPicked] = useState<number | null>(null);
  const pick = (step: number) => {
    setPicked(step);
    requestAnimationFrame(() => document.querySelector("[data-testid=inspect]")?.scrollIntoView({ block: "start" }));
  };
  const ended = ENDED.has(status?.status ?? "");
  const phase = startupPhase({ logLines: live.log.length, stageSeen: live.stageSeen || status?.stage_source === "reported",
    evals: live.evals.length, rows: live.rows.length, ended });
  return (
    <div class="page" data-testid="page-watch">
      <header class="page-head">
        <div>
          <h1>Watch</h1>
          <p class="muted">{s.runId ? <span class="mono" data-testid="run-id">{s.runId}</span> : "No run selected: launch one, or open one from Runs."}</p>
        </div>
        {s.runId && (
          <div class="row" role="status" aria-live="polite" aria-label="run status">
            <span class={`badge status-${status?.status ?? "unknown"}`} data-testid="run-status">
              {status?.status ?? "connecting"}
            </span>
            <span class="mono muted" data-testid="run-step">
              step {status?.step ?? 0}/{status?.total_steps ?? "?"}
            </span>
            {status?.status === "running" && (
              <button class="btn" data-testid="stop-run" disabled={stopping}
                onClick={() => { setStopping(true); api.stop(s.runId!).finally(() => setStopping(false)); }}>
                Stop
              </button>
            )}
          </div>
        )}
      </header>
      <Launcher />
      {s.runId && (
        <>
          <AlarmBanner alarms={live.alarms} />
          {phase < 4 && <Startup phase={phase} since={live.opened} />}
          <Stages rows={live.rows} status={status} />
          <Timeline rows={live.rows} alarms={live.alarms} />
          <div class="row">
            <SmoothingControl value={smoothing} onChange={setSmoothing} />
            <span class="muted small">click a point for that step's samples; drag across a chart to zoom, double-click to zoom out</span>
          </div>
          <Charts rows={live.rows} klOff={klOff} smoothing={smoothing} mode={status?.mode} onPick={pick} />
          {live.evals.length > 0 && (
            <p class="muted small" data-testid="evals">
              held-out: {live.evals.map((r) => `step ${r.step}: accuracy ${num(r, "eval/accuracy") === null ? "—" : formatNumber(num(r, "eval/accuracy")!)}`).join(" · ")}
            </p>
          )}
          <EfficiencyPanel runId={s.runId} row={live.efficiency} />
          {status?.status === "finished" && <TryPanel runId={s.runId} />}
          {live.samples.length > 0 && <Inspect samples={live.samples} step={picked} onStep={setPicked} />}
          <details class="card" open={status?.status === "failed" || phase < 4} data-testid="run-log-box">
            <summary>Log ({live.log.length} lines)</summary>
            <pre class="code log" data-testid="run-log">{live.log.join("\n")}</pre>
          </details>
        </>
      )}
    </div>
  );
}
