// The memory estimate from /api/estimate (composer/memory.py): one stacked bar per model and one per
// device against the budget, warnings, the backend recommendation, and a budget slider whose answer is
// a micro-batch and gradient accumulation (with the ordered proposals when nothing fits).
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Mode } from "../api";
import { getPath, getState, setPath, update, useStore } from "../store";

interface ModelMem {
  role: string;
  device: string;
  trainable: boolean;
  params: number;
  trainable_params: number;
  bytes: Record<string, number>;
  peak_bytes?: number; // what the model holds at its busiest phase (older estimators: total_bytes)
  total_bytes?: number;
}

function modelBytes(m: ModelMem): number {
  return m.peak_bytes ?? m.total_bytes ?? Object.values(m.bytes).reduce((a, b) => a + b, 0);
}
interface DeviceMem {
  name: string;
  count: number;
  persistent_bytes: number;
  phase_bytes: Record<string, number>;
  peak_phase: string;
  overhead_bytes: number;
  margin_bytes: number;
  total_bytes: number;
  budget_bytes: number | null;
  fits: boolean | null;
}
interface Budget {
  max_tokens: number;
  micro_batch: number;
  grad_accum: number;
  fits: boolean;
  rollout_fits: boolean;
  suggested_micro_batch_tokens: number;
  bytes_per_token: number;
  proposals: { action: string; setting: string; saving_bytes: number; fits_after: boolean }[];
}
export interface Placement {
  nodes: number;
  trainer_ranks: number;
  engine_replicas: number;
  colocate: boolean;
  trainer_devices: string[];
  engine_devices: string[];
  lines: string[];
}

export interface Estimate {
  models: ModelMem[];
  devices: DeviceMem[];
  warnings: string[];
  recommendation: { backend: string; num_devices: number | null; reason: string } | null;
  budget: Budget | null;
  /** Where a `cluster: {backend: ray}` config puts its trainer ranks and engine replicas (`tokenmill plan`). */
  placement?: Placement;
  settings?: Record<string, unknown>;
  model?: Record<string, unknown>;
}

const COLORS: Record<string, string> = {
  weights: "#2563eb", gradients: "#7c3aed", optimizer: "#db2777", fsdp_buffers: "#0891b2", activations: "#ea580c",
  logits: "#ca8a04", logits_nograd: "#facc15", kv_cache: "#16a34a", persistent: "#2563eb", peak: "#ea580c",
  overhead: "#64748b", margin: "#cbd5e1",
};
const GIB = 1024 ** 3;
/** Where "micro-batch tokens" lives in each mode's config (preference training has no such knob). */
const MICRO_BATCH_PATH: Partial<Record<Mode, string>> = { rl: "training.micro_batch_tokens", sft: "micro_batch_tokens" };

export function gib(bytes: number): string {
  return `${(bytes / GIB).toFixed(bytes >= 10 * GIB ? 1 : 2)} GiB`;
}

function Bar({ items, scale, budget }: { items: [string, number][]; scale: number; budget?: number | null }) {
  return (
    <div class="mem-bar">
      {items.map(([k, v]) => (
        <div title={`${k.replace(/_/g, " ")}: ${gib(v)}`} style={{ width: `${(100 * v) / scale}%`, background: COLORS[k] ?? "#94a3b8" }} />
      ))}
      {budget ? <span class="budget" title={`budget ${gib(budget)}`} style={{ left: `${Math.min(99.7, (100 * budget) / scale)}%` }} /> : null}
    </div>
  );
}

const NO_MODEL = "Choose a model (model.path on the Compose page) to see its memory estimate.";

function useEstimate(): { estimate: Estimate | null; error: string | null } {
  const s = useStore();
  const [out, setOut] = useState<{ estimate: Estimate | null; error: string | null }>({ estimate: null, error: null });
  useEffect(() => {
    let live = true;
    if (!getPath(s.config, "model.path")) {
      // nothing to estimate yet: no request (it could only be refused), a hint instead
      setOut({ estimate: null, error: NO_MODEL });
      return;
    }
    const timer = setTimeout(() => {
      api.estimate(s.mode, s.config, s.deviceMemoryGib, s.numDevices).then(
        (estimate) => live && setOut({ estimate: estimate as unknown as Estimate, error: null }),
        (e) => live && setOut({ estimate: null, error: e.message }),
      );
    }, 200);
    return () => {
      live = false;
      clearTimeout(timer);
    };
  }, [s.mode, JSON.stringify(s.config), s.deviceMemoryGib, s.numDevices]);
  return out;
}

function Legend({ keys }: { keys: string[] }) {
  return (
    <div class="legend">
      {keys.map((k) => (
        <span>
          <i style={{ background: COLORS[k] ?? "#94a3b8" }} />
          {k.replace(/_/g, " ")}
        </span>
      ))}
    </div>
  );
}

function BudgetSlider({ budget }: { budget: Budget | null }) {
  const s = useStore();
  const path = MICRO_BATCH_PATH[s.mode];
  const current = path ? getPath(s.config, path) : undefined;
  return (
    <div class="budget-box" data-testid="memory-budget">
      <label class="inline" title="Memory of one device; the estimate proposes the largest micro-batch that fits it.">
        <span class="muted small">budget per device</span>
        <input type="range" min={4} max={192} step={1} value={s.deviceMemoryGib} data-testid="budget-slider"
          onInput={(e) => update({ deviceMemoryGib: Number((e.target as HTMLInputElement).value) })} />
        <span class="mono" data-testid="budget-value">{s.deviceMemoryGib} GiB</span>
      </label>
      {budget && (
        <div class="proposal">
          <div class="stat"><div class="muted small">max tokens per micro-batch</div><div class="v">{budget.max_tokens.toLocaleString()}</div></div>
          <div class="stat"><div class="muted small">micro-batch (sequences)</div><div class="v" data-testid="budget-micro-batch">{budget.micro_batch}</div></div>
          <div class="stat"><div class="muted small">gradient accumulation</div><div class="v" data-testid="budget-grad-accum">{budget.grad_accum}</div></div>
          <div class="stat"><div class="muted small">per token</div><div class="v">{(budget.bytes_per_token / 1024).toFixed(0)} KiB</div></div>
        </div>
      )}
      {budget && budget.fits && path && current === budget.suggested_micro_batch_tokens && (
        <p class="muted small" data-testid="budget-applied">{path} is {budget.suggested_micro_batch_tokens.toLocaleString()}: what this budget allows.</p>
      )}
      {budget && budget.fits && path && current !== budget.suggested_micro_batch_tokens && (
        <div class="row" style={{ marginTop: "8px" }}>
          <button class="btn" data-testid="budget-apply"
            onClick={() => update({ config: setPath(getState().config, path, budget.suggested_micro_batch_tokens) })}>
            Set {path} = {budget.suggested_micro_batch_tokens.toLocaleString()}
          </button>
          <span class="muted small">now {current === undefined ? "default" : String(current)}</span>
        </div>
      )}
      {budget && !budget.fits && budget.proposals.length > 0 && (
        <div data-testid="budget-proposals">
          <p class="over">Not even one sequence fits{budget.rollout_fits ? "" : " (nor the rollout)"}. In order:</p>
          <ol class="small">
            {budget.proposals.map((p) => (
              <li>
                {p.action} — <span class="mono">{p.setting}</span>, saves {gib(p.saving_bytes)}
                {p.fits_after ? <b> → fits</b> : ""}
              </li>
            ))}
          </ol>
        </div>
      )}
    </div>
  );
}

/** The plan of `tokenmill plan`: devices per role, computed by the server without starting anything. */
function PlacementView({ placement }: { placement: Placement }) {
  const roles: [string, string, string[]][] = [
    ["trainer", `${placement.trainer_ranks} trainer rank(s)`, placement.trainer_devices],
    ["engine", `${placement.engine_replicas} engine replica(s)${placement.colocate ? ", colocated with the ranks" : ""}`, placement.engine_devices],
  ];
  return (
    <div data-testid="placement">
      <h3 style={{ marginTop: "14px" }}>Placement on {placement.nodes} node(s)</h3>
      <div class="table-wrap">
        <table class="table">
          <tbody>
            {roles.map(([role, title, devices]) => (
              <tr data-testid={`placement-${role}`} data-devices={devices.join("|")}>
                <td>{title}</td>
                <td class="mono small">{devices.join(" · ") || "—"}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      <details>
        <summary class="small">as <span class="mono">tokenmill plan</span> prints it</summary>
        <pre class="code" data-testid="placement-lines">{placement.lines.join("\n")}</pre>
      </details>
    </div>
  );
}

/** One recommendation: the backend when the config fits, else the first change that makes it fit. */
function Recommendation({ estimate }: { estimate: Estimate }) {
  const fits = estimate.devices.every((d) => d.fits !== false) && estimate.budget?.fits !== false;
  const rec = estimate.recommendation;
  if (fits) {
    return rec ? (
      <div class="alert ok" data-testid="memory-recommendation" data-fits="true">
        <b>{rec.backend.replace(/_/g, " ")}</b>
        {rec.num_devices ? ` on ${rec.num_devices} device(s)` : ""}: {rec.reason}
      </div>
    ) : null;
  }
  const proposals = estimate.budget?.proposals ?? [];
  const first = proposals.find((p) => p.fits_after) ?? proposals[0];
  return (
    <div class="alert warn" data-testid="memory-recommendation" data-fits="false">
      <b>Does not fit this budget.</b>{" "}
      {first
        ? `Recommended: ${first.action} (${first.setting}), which saves ${gib(first.saving_bytes)}${first.fits_after ? " and then fits" : ""}.`
        : "Train LoRA adapters, shorten the sequences or add device memory."}
    </div>
  );
}

export function MemoryPanel() {
  const { estimate, error } = useEstimate();
  if (error === NO_MODEL) return <p class="muted" data-testid="memory-no-model">{error}</p>;
  if (error) return <div class="alert error" data-testid="memory-error">{error}</div>;
  if (!estimate) return <p class="muted">Estimating…</p>;
  const devices = estimate.devices ?? [];
  const scale = Math.max(...devices.map((d) => Math.max(d.total_bytes, d.budget_bytes ?? 0)), 1);
  const parts = [...new Set(estimate.models.flatMap((m) => Object.keys(m.bytes)))];
  return (
    <div data-testid="memory">
      {estimate.warnings.map((w) => (
        <div class="alert warn" data-testid="memory-warning">{w}</div>
      ))}
      <Recommendation estimate={estimate} />
      {estimate.placement && <PlacementView placement={estimate.placement} />}
      <h3 style={{ marginTop: "14px" }}>Per model</h3>
      <Legend keys={parts} />
      <div class="mem-bars" data-testid="memory-models">
        {estimate.models.map((m) => (
          <div class="mem-row" data-testid={`memory-model-${m.role}`} data-bytes={modelBytes(m)}>
            <div>
              <b>{m.role}</b>{" "}
              <span class="muted small">
                {m.device} · <span data-testid={`memory-params-${m.role}`}>{formatCount(m.params)}</span> parameters{m.trainable ? "" : " · frozen"}
              </span>
            </div>
            <Bar items={Object.entries(m.bytes)} scale={scale} />
            <div class="mono" title="at its busiest phase">{gib(modelBytes(m))}</div>
          </div>
        ))}
      </div>
      <h3 style={{ marginTop: "16px" }}>Per device</h3>
      <Legend keys={["persistent", "peak", "overhead", "margin"]} />
      <div class="mem-bars" data-testid="memory-devices">
        {devices.map((d) => {
          const peak = d.phase_bytes[d.peak_phase] ?? 0;
          const over = d.fits === false;
          return (
            <div class="mem-row" data-testid={`memory-device-${d.name}`} data-over={String(over)}>
              <div>
                <b>{d.name}</b>
                <span class="muted small">{d.count > 1 ? ` × ${d.count}` : ""} · peak: {d.peak_phase}</span>
              </div>
              <Bar scale={scale} budget={d.budget_bytes}
                items={[["persistent", d.persistent_bytes], ["peak", peak], ["overhead", d.overhead_bytes], ["margin", d.margin_bytes]]} />
              <div class={`mono${over ? " over" : ""}`}>
                {gib(d.total_bytes)}
                {d.budget_bytes ? ` / ${gib(d.budget_bytes)}` : ""}
              </div>
            </div>
          );
        })}
      </div>
      <h3 style={{ marginTop: "16px" }}>Budget</h3>
      <BudgetSlider budget={estimate.budget} />
    </div>
  );
}

/** A count in human units: 312, 20.3K, 0.5M, 494M, 1.2B (three significant digits at most). */
export function formatCount(n: number): string {
  const units: [number, string][] = [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]];
  for (const [size, unit] of units) {
    if (n >= size / 2) { // 500,000 is 0.5M; 494,032,768 is 494M
      const v = n / size;
      return `${v >= 100 ? v.toFixed(0) : v >= 10 ? Number(v.toFixed(1)) : Number(v.toFixed(2))}${unit}`;
    }
  }
  return String(n);
}
