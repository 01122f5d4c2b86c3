// Panels of the Watch page that come from a run's events.jsonl and log rather than its metrics: the start-up
// stages before the first step, the health alarms banner, and the efficiency report.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Alarm } from "../api";
import { formatNumber } from "./chart";

export type Row = Record<string, unknown>;

/** What the run is doing before its first metrics row, read from what it has written so far. */
export function startupPhase(p: { logLines: number; stageSeen: boolean; evals: number; rows: number; ended: boolean }): number {
  if (p.rows > 0 || p.ended) return 4;
  if (p.stageSeen) return 3;
  if (p.evals > 0) return 2; // the step-0 evaluation is done; the first step is being prepared
  return p.logLines > 0 ? 1 : 0;
}

const PHASES = [
  "starting the process (Python, torch, tokenmill)",
  "loading the model and data; held-out evaluation",
  "preparing the first step",
  "first step: generate, reward, train",
];

export function Startup({ phase, since }: { phase: number; since: number }) {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    const timer = setInterval(() => setNow(Date.now()), 1000);
    return () => clearInterval(timer);
  }, []);
  return (
    <div class="card" data-testid="startup" data-phase={phase}>
      <h2>Starting</h2>
      <p class="muted small">
        {Math.round((now - since) / 1000)} s since this page opened the run; the first curve point comes with the first step.
        The log below shows what the run prints meanwhile.
      </p>
      <ol class="startup">
        {PHASES.map((label, i) => (
          <li class={i < phase ? "done" : i === phase ? "now" : ""} data-testid={`startup-${i}`}>
            {i < phase ? "✓ " : i === phase ? "… " : ""}
            {label}
          </li>
        ))}
      </ol>
    </div>
  );
}

/** The health alarms the trainer raised, the latest of each, newest first. */
export function AlarmBanner({ alarms }: { alarms: Alarm[] }) {
  if (!alarms.length) return null;
  const latest = new Map<string, Alarm>();
  alarms.forEach((a) => latest.set(a.name, a));
  const shown = [...latest.values()].sort((a, b) => (b.step ?? 0) - (a.step ?? 0));
  return (
    <div class="card alarms" role="alert" data-testid="alarm-banner">
      <h2>Health alarms ({shown.length})</h2>
      <ul>
        {shown.map((a) => (
          <li data-testid={`alarm-${a.name}`}>
            <b>{a.name}</b> at step {a.step}: {a.message}{" "}
            <span class="mono muted small">
              ({a.metric} = {typeof a.value === "number" ? formatNumber(a.value) : String(a.value)}, threshold{" "}
              {typeof a.threshold === "number" ? formatNumber(a.threshold) : String(a.threshold)}; policy {a.policy})
            </span>
          </li>
        ))}
      </ul>
    </div>
  );
}

function flatten(value: unknown, prefix = ""): [string, string][] {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    return Object.entries(value as Row).flatMap(([k, v]) => flatten(v, prefix ? `${prefix}.${k}` : k));
  }
  const shown = typeof value === "number" ? formatNumber(value) : typeof value === "string" ? value : JSON.stringify(value);
  return [[prefix, shown]];
}

/** The trainer's efficiency report: its events.jsonl row, then report.json from the run folder when there. */
export function EfficiencyPanel({ runId, row }: { runId: string; row: Row | null }) {
  const [report, setReport] = useState<Row | null>(null);
  useEffect(() => {
    setReport(null);
    if (!row) return;
    let live = true;
    api.report(runId).then((r) => live && setReport(r.report), () => undefined); // none (yet): the row alone
    return () => {
      live = false;
    };
  }, [runId, row]);
  if (!row) return null;
  const { event: _event, ...fields } = row;
  const entries = flatten(report ?? fields);
  return (
    <div class="card" data-testid="efficiency">
      <h2>Efficiency report</h2>
      <p class="muted small">{report ? "report.json of the run folder" : "as the trainer reported it"}</p>
      <div class="table-wrap">
        <table class="table">
          <tbody>
            {entries.map(([k, v]) => (
              <tr data-testid={`efficiency-${k}`}>
                <td class="mono">{k}</td>
                <td class="num mono">{v}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </div>
  );
}
