// Inspect a run's samples (samples.jsonl): the recent ones, searched and filtered by stop reason and reward; or
// one step's (picked from the step list or by clicking a point of a curve) as GRPO groups side by side: the
// prompt once, then each completion with every reward function's score, the total, the advantage, the length
// and whether it was cut at max_tokens; and the histogram of that step's rewards. A completion the run logged
// with its tokens (samples.jsonl's `tokens`: [text, logprob] each) is shown token by token, shaded by the
// logprob it was sampled with (pale: the policy was sure; null: a token it did not write, left unshaded).
import { useState } from "preact/hooks";
import { formatNumber } from "./chart";
import type { Row } from "./runpanels";
import { tokenShade } from "./trypanel";

const BINS = 10;

function num(row: Row, key: string): number | null {
  const v = row[key];
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

const fmt = (v: number | null | undefined) => (typeof v === "number" ? formatNumber(v) : "—");
const text = (row: Row, key: string) => String(row[key] ?? "");

/** Rewards in BINS equal bins from their min to max: [{from, to, count}]. */
export function histogram(values: number[]): { from: number; to: number; count: number }[] {
  if (values.length === 0) return [];
  const lo = Math.min(...values);
  const hi = Math.max(...values);
  if (hi === lo) return [{ from: lo, to: hi, count: values.length }];
  const width = (hi - lo) / BINS;
  const bins = Array.from({ length: BINS }, (_, i) => ({ from: lo + i * width, to: lo + (i + 1) * width, count: 0 }));
  values.forEach((v) => (bins[Math.min(BINS - 1, Math.floor((v - lo) / width))].count += 1));
  return bins;
}

function Histogram({ values }: { values: number[] }) {
  const bins = histogram(values);
  const most = Math.max(1, ...bins.map((b) => b.count));
  return (
    <div class="histogram" data-testid="reward-histogram" data-bins={bins.map((b) => b.count).join(",")}
      role="img" aria-label={`reward histogram of ${values.length} samples`}>
      {bins.map((b) => (
        <div class="bin" title={`${fmt(b.from)} to ${fmt(b.to)}: ${b.count}`}>
          <div class="bar" style={{ height: `${(100 * b.count) / most}%` }} />
          <span class="mono small">{fmt(b.from)}</span>
        </div>
      ))}
    </div>
  );
}

/** The completion token by token, each shaded by its logprob, when the record has `tokens`; else its text. */
function Completion({ row }: { row: Row }) {
  const tokens = row.tokens;
  if (!Array.isArray(tokens) || !tokens.length) return <>{text(row, "completion")}</>;
  return (
    <span class="tokens" data-testid="sample-tokens">
      {(tokens as [string, number | null][]).map(([t, lp]) => typeof lp === "number" ? (
        <span class="tok" data-logprob={lp} title={`logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})`}
          style={{ background: tokenShade(lp) }}>{t}</span>
      ) : <span class="tok" title="not written by the policy">{t}</span>)}
    </span>
  );
}

function Group({ prompt, rows, index }: { prompt: string; rows: Row[]; index: number }) {
  const names = [...new Set(rows.flatMap((r) => Object.keys((r.rewards as Record<string, unknown>) ?? {})))];
  return (
    <div class="group-view" data-testid={`group-${index}`}>
      <div class="muted small">prompt</div>
      <pre class="mono small prompt">{prompt}</pre>
      <div class="table-wrap">
        <table class="table">
          <thead>
            <tr>
              <th>completion</th>
              {names.map((n) => <th class="num">{n}</th>)}
              <th class="num">reward</th><th class="num">advantage</th><th class="num">chars</th><th>stop</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((r) => (
              <tr data-testid="group-sample">
                <td class="text mono"><Completion row={r} /></td>
                {names.map((n) => <td class="num mono">{fmt(((r.rewards as Record<string, number | null>) ?? {})[n])}</td>)}
                <td class="num mono">{fmt(num(r, "reward"))}</td>
                <td class="num mono">{fmt(num(r, "advantage"))}</td>
                <td class="num mono">{text(r, "completion").length}</td>
                <td>{r.stop === "length" ? <span class="badge bad" title="cut at generation.max_tokens">truncated</span> : text(r, "stop")}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </div>
  );
}

function StepView({ rows, step }: { rows: Row[]; step: number }) {
  const groups = new Map<string, Row[]>();
  rows.forEach((r) => groups.set(text(r, "prompt"), [...(groups.get(text(r, "prompt")) ?? []), r]));
  const rewards = rows.map((r) => num(r, "reward")).filter((v): v is number => v !== null);
  return (
    <div data-testid="step-view" data-step={step}>
      <p class="muted small">
        step {step}: {rows.length} sample(s) in {groups.size} group(s) (samples.jsonl keeps `tracking.log_samples` per step)
      </p>
      <Histogram values={rewards} />
      {[...groups.entries()].map(([prompt, g], i) => <Group prompt={prompt} rows={g} index={i} />)}
    </div>
  );
}

export function Inspect({ samples, step, onStep }: { samples: Row[]; step: number | null; onStep: (s: number | null) => void }) {
  const [stop, setStop] = useState("");
  const [minReward, setMinReward] = useState("");
  const [query, setQuery] = useState("");
  const stops = [...new Set(samples.map((s) => String(s.stop ?? "")))].filter(Boolean);
  const steps = [...new Set(samples.map((s) => num(s, "step")).filter((v): v is number => v !== null))].sort((a, b) => b - a);
  const q = query.trim().toLowerCase();
  const filtered = samples
    .filter((s) => !stop || s.stop === stop)
    .filter((s) => minReward === "" || (num(s, "reward") ?? -Infinity) >= Number(minReward))
    .filter((s) => !q || `${text(s, "prompt")}\n${text(s, "completion")}`.toLowerCase().includes(q));
  const ofStep = step === null ? [] : filtered.filter((s) => num(s, "step") === step);
  const shown = filtered.slice(-20).reverse();
  return (
    <div class="card" data-testid="inspect">
      <div class="card-head">
        <h2>{step === null ? "Recent samples" : `Samples of step ${step}`}</h2>
        <div class="row">
          <select class="input auto" value={step === null ? "" : String(step)} aria-label="step" data-testid="samples-step"
            onChange={(e) => {
              const v = (e.target as HTMLSelectElement).value;
              onStep(v === "" ? null : Number(v));
            }}>
            <option value="">recent</option>
            {steps.map((s) => <option value={String(s)}>step {s}</option>)}
          </select>
          <input class="input filter" type="search" placeholder="search text" value={query} aria-label="search samples"
            data-testid="samples-search" onInput={(e) => setQuery((e.target as HTMLInputElement).value)} />
          <select class="input auto" value={stop} onChange={(e) => setStop((e.target as HTMLSelectElement).value)} data-testid="samples-stop" aria-label="stop reason">
            <option value="">any stop</option>
            {stops.map((s) => <option value={s}>{s}</option>)}
          </select>
          <input class="input filter" type="number" step="any" placeholder="min reward" value={minReward}
            onInput={(e) => setMinReward((e.target as HTMLInputElement).value)} data-testid="samples-min-reward" aria-label="minimum reward" />
        </div>
      </div>
      {step !== null ? (
        ofStep.length ? <StepView rows={ofStep} step={step} /> : <p class="muted small" data-testid="step-none">No sample of step {step} matches (samples.jsonl keeps a few per step).</p>
      ) : (
        <div class="table-wrap">
          <table class="table" data-testid="samples-table">
            <thead>
              <tr><th>step</th><th>prompt</th><th>completion</th><th class="num">reward</th><th class="num">advantage</th><th>stop</th><th class="num">chars</th></tr>
            </thead>
            <tbody>
              {shown.map((s) => (
                <tr>
                  <td class="mono">{text(s, "step")}</td>
                  <td class="text">{text(s, "prompt")}</td>
                  <td class="text mono"><Completion row={s} /></td>
                  <td class="num mono">{fmt(num(s, "reward"))}</td>
                  <td class="num mono">{fmt(num(s, "advantage"))}</td>
                  <td>{text(s, "stop")}</td>
                  <td class="num mono">{text(s, "completion").length}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {step === null && shown.length === 0 && <p class="muted small">No samples yet.</p>}
    </div>
  );
}
