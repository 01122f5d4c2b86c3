// 2-4 runs side by side: the pinned RL panels (reward, accuracy, KL, entropy, length, step time) against the
// step, the wall time or the tokens, a searchable picker for every other shared metric (constant ones hidden),
// the config keys that differ with their effective values (reward code by content, with its diff), and the
// same prompt's completions from each run. What is shown lives in the address: a reload or a link reopens it.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Comparison, RunInfo, SharedSamples } from "../api";
import { align, formatNumber, LineChart, SmoothingControl } from "./chart";

export const COLORS = ["#2563eb", "#db2777", "#16a34a", "#ea580c"];
// shown first, in this order, when the runs share them (RL's, then SFT / preference / reward-model runs')
export const PINNED = ["reward/mean", "eval/accuracy", "kl", "entropy", "response_len/mean", "timing_s/step",
  "loss", "accuracy", "margin", "eval/loss"];
export const X_AXES = [
  { id: "step", title: "step", label: "step" },
  { id: "wall_s", title: "wall time", label: "wall time (s)" },
  { id: "tokens", title: "tokens", label: "tokens" },
] as const;
export type XAxis = (typeof X_AXES)[number]["id"];

export interface CompareState {
  ids: string[];
  x: XAxis;
  extra: string[]; // metrics added from the picker
}

const label = (r: RunInfo) => r.name || r.id;
const testKey = (m: string) => m.replace(/[^A-Za-z0-9_-]/g, "_");

function show(v: unknown): string {
  return v === null || v === undefined ? "—" : typeof v === "string" ? v : JSON.stringify(v);
}

/** Each run's [x, value] points on the chosen axis (a run without that axis has none). */
function onAxis(run: Comparison["runs"][number], metric: string, x: XAxis): [number, number][] {
  const points = run.curves[metric] ?? [];
  if (x === "step") return points;
  const at = new Map((run.axes?.[x] ?? []).map(([step, v]) => [step, v]));
  return points.filter(([step]) => at.has(step)).map(([step, v]) => [at.get(step)!, v]);
}

function Picker(props: { metrics: string[]; chosen: string[]; onChange: (m: string[]) => void; hidden: number }) {
  const [query, setQuery] = useState("");
  const q = query.trim().toLowerCase();
  const matches = props.metrics.filter((m) => !q || m.toLowerCase().includes(q));
  return (
    <details class="picker" data-testid="metric-picker">
      <summary>More metrics ({props.metrics.length}{props.hidden ? `; ${props.hidden} constant ones hidden` : ""})</summary>
      <input class="input" type="search" placeholder="search metrics" aria-label="search metrics" value={query}
        data-testid="metric-search" onInput={(e) => setQuery((e.target as HTMLInputElement).value)} />
      <div class="picker-list">
        {matches.slice(0, 40).map((m) => (
          <label class="inline small" key={m}>
            <input type="checkbox" checked={props.chosen.includes(m)} data-testid={`pick-metric-${testKey(m)}`}
              onChange={(e) => props.onChange((e.target as HTMLInputElement).checked ? [...props.chosen, m] : props.chosen.filter((c) => c !== m))} />
            <span class="mono">{m}</span>
          </label>
        ))}
        {matches.length > 40 && <span class="muted small">{matches.length - 40} more: narrow the search</span>}
        {matches.length === 0 && <span class="muted small">No metric matches.</span>}
      </div>
    </details>
  );
}

function ConfigDiff({ data }: { data: Comparison }) {
  const codes = new Map(data.reward_code.map((c) => [c.name, c]));
  if (data.config_diff.length === 0) return <p class="muted" data-testid="compare-same-config">The configs are the same (defaults included).</p>;
  return (
    <>
      <div class="table-wrap">
        <table class="table diff" data-testid="compare-diff">
          <thead>
            <tr><th>key</th>{data.runs.map((r) => <th>{label(r)}</th>)}</tr>
          </thead>
          <tbody>
            {data.config_diff.map((d) => (
              <tr data-testid={`diff-${d.path}`}>
                <td class="mono">{d.path}</td>
                {data.runs.map((r) => (
                  <td class="mono" data-run={r.id}>{d.path.endsWith(".code") ? "code " + show(d.values[r.id]).slice(7, 15) : show(d.values[r.id])}</td>
                ))}
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      {[...codes.values()].map((c) => (
        <details class="code-diff" data-testid={`reward-diff-${c.name}`}>
          <summary>Reward <span class="mono">{c.name}</span>: the code differs</summary>
          {Object.entries(c.diff).map(([rid, text]) => (
            <pre class="code diff-text" data-run={rid}>
              {text.split("\n").map((line) => (
                <span class={line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : ""}>{line + "\n"}</span>
              ))}
            </pre>
          ))}
        </details>
      ))}
    </>
  );
}

function SamePrompt({ ids, runs }: { ids: string[]; runs: RunInfo[] }) {
  const [data, setData] = useState<SharedSamples | null>(null);
  const [prompt, setPrompt] = useState<string | null>(null);
  useEffect(() => {
    let live = true;
    api.compareSamples(ids, prompt).then((d) => live && setData(d), () => live && setData(null));
    return () => {
      live = false;
    };
  }, [ids.join(","), prompt]);
  if (!data || data.prompts.length === 0) return <p class="muted small" data-testid="same-prompt-none">These runs have no sampled prompt in common.</p>;
  return (
    <div data-testid="same-prompt">
      <label class="inline">
        <span class="muted small">prompt</span>
        <select class="input" aria-label="prompt to compare" data-testid="same-prompt-select" value={data.prompt ?? ""}
          onChange={(e) => setPrompt((e.target as HTMLSelectElement).value)}>
          {data.prompts.map((p) => <option value={p}>{p.length > 80 ? p.slice(0, 80) + "…" : p}</option>)}
        </select>
      </label>
      <div class="side-by-side">
        {runs.map((r, i) => (
          <div class="side" data-testid={`same-prompt-run-${r.id}`} style={{ borderTopColor: COLORS[i % COLORS.length] }}>
            <b>{label(r)}</b>
            {(data.completions[r.id] ?? []).map((c) => (
              <div class="completion">
                <div class="muted small">step {String(c.step ?? "?")} · reward {typeof c.reward === "number" ? formatNumber(c.reward) : "—"}
                  {typeof c.advantage === "number" ? ` · adv ${formatNumber(c.advantage)}` : ""}{c.stop ? ` · ${c.stop}` : ""}</div>
                <pre class="mono small">{c.completion}</pre>
              </div>
            ))}
            {(data.completions[r.id] ?? []).length === 0 && <p class="muted small">no sample of this prompt</p>}
          </div>
        ))}
      </div>
    </div>
  );
}

export function CompareView({ state, onState }: { state: CompareState; onState: (s: CompareState) => void }) {
  const [data, setData] = useState<Comparison | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [smoothing, setSmoothing] = useState(0);
  useEffect(() => {
    let live = true;
    setData(null);
    api.compare(state.ids).then((d) => live && (setData(d), setError(null)), (e) => live && setError(e.message));
    return () => {
      live = false;
    };
  }, [state.ids.join(",")]);
  if (error) return <div class="alert error" data-testid="compare-error">{error}</div>;
  if (!data) return <p class="muted">Loading…</p>;
  const constant = new Set(data.constant ?? []);
  const varying = data.metrics.filter((m) => !constant.has(m));
  const pinned = PINNED.filter((m) => varying.includes(m));
  const rest = varying.filter((m) => !pinned.includes(m));
  const extra = state.extra.filter((m) => rest.includes(m));
  const axis = X_AXES.find((a) => a.id === state.x) ?? X_AXES[0];
  const hasAxis = (x: XAxis) => x === "step" || data.runs.every((r) => (r.axes?.[x] ?? []).length > 0);
  return (
    <div class="card" data-testid="compare">
      <div class="card-head">
        <h2>Compare {data.runs.length} runs</h2>
        <div class="row">
          <div class="segmented" role="group" aria-label="x axis" data-testid="x-axis">
            {X_AXES.map((a) => (
              <button class={a.id === axis.id ? "active" : ""} aria-pressed={a.id === axis.id} disabled={!hasAxis(a.id)}
                data-testid={`x-axis-${a.id}`} title={hasAxis(a.id) ? "" : "a run logs no step time"}
                onClick={() => onState({ ...state, x: a.id })}>{a.title}</button>
            ))}
          </div>
          <SmoothingControl value={smoothing} onChange={setSmoothing} />
        </div>
      </div>
      {data.metrics.length === 0 && <p class="muted">These runs share no metric.</p>}
      <div class="chart-grid" data-testid="compare-charts">
        {[...pinned, ...extra].map((m) => {
          const { steps, values } = align(data.runs.map((r) => onAxis(r, m, axis.id)));
          return (
            <LineChart title={m} testId={`compare-chart-${testKey(m)}`} steps={steps} smoothing={smoothing} xLabel={axis.label}
              series={data.runs.map((r, i) => ({ label: label(r), values: values[i], color: COLORS[i % COLORS.length] }))} />
          );
        })}
      </div>
      {rest.length > 0 && <Picker metrics={rest} chosen={extra} hidden={constant.size} onChange={(m) => onState({ ...state, extra: m })} />}
      <h3>Config differences</h3>
      <ConfigDiff data={data} />
      <h3>The same prompt</h3>
      <SamePrompt ids={state.ids} runs={data.runs} />
    </div>
  );
}
