// The memory estimate from /api/estimate, drawn as one stacked bar per model and per device against
// the budget, with warnings, the backend recommendation and the budget proposal (micro-batch, accumulation).
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import { getState, setPath, update, useStore } from "../store";

type Dict = Record<string, any>;
const PARTS = ["weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "overhead"];
const PART_COLORS: Record<string, string> = {
  weights: "#2563eb", gradients: "#7c3aed", optimizer: "#db2777", activations: "#ea580c",
  logits: "#ca8a04", kv_cache: "#16a34a", overhead: "#64748b",
};
const GIB = 1024 ** 3;

export function gib(bytes: number): string {
  return `${(bytes / GIB).toFixed(bytes >= 10 * GIB ? 1 : 2)} GiB`;
}

/** The byte components of one model entry: {weights: n, ...}, whatever key holds them. */
function parts(entry: Dict): [string, number][] {
  const src: Dict = entry.bytes ?? entry.breakdown ?? entry;
  return Object.entries(src).filter(([k, v]) => typeof v === "number" && k !== "total" && !k.endsWith("total")) as [string, number][];
}

function colorOf(part: string, i: number): string {
  return PART_COLORS[part] ?? PART_COLORS[PARTS.find((p) => part.startsWith(p)) ?? ""] ?? ["#0891b2", "#9333ea", "#65a30d"][i % 3];
}

function Bar({ items, scale, budget }: { items: [string, number][]; scale: number; budget?: number }) {
  return (
    <div class="mem-bar">
      {items.map(([k, v], i) => (
        <div title={`${k}: ${gib(v)}`} style={{ width: `${(100 * v) / scale}%`, background: colorOf(k, i) }} />
      ))}
      {budget !== undefined && budget < scale * 1.0001 && <span class="budget" style={{ left: `${(100 * budget) / scale}%` }} />}
    </div>
  );
}

export function useEstimate(): { estimate: Dict | null; error: string | null } {
  const s = useStore();
  const [out, setOut] = useState<{ estimate: Dict | null; error: string | null }>({ estimate: null, error: null });
  useEffect(() => {
    let live = true;
    const timer = setTimeout(() => {
      api.estimate(s.mode, s.config, s.deviceMemoryGib, s.numDevices).then(
        (estimate) => live && setOut({ estimate, error: null }),
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

function asList(x: unknown): Dict[] {
  if (Array.isArray(x)) return x as Dict[];
  if (x && typeof x === "object") return Object.entries(x).map(([k, v]) => ({ device: k, ...(typeof v === "object" ? v : { total: v }) }));
  return [];
}

export function MemoryPanel() {
  const { estimate, error } = useEstimate();
  if (error) return <div class="alert error" data-testid="memory-error">{error}</div>;
  if (!estimate) return <p class="muted">Estimating…</p>;
  const models = asList(estimate.models);
  const devices = asList(estimate.devices ?? estimate.totals);
  const warnings: string[] = (estimate.warnings ?? []).map((w: unknown) => (typeof w === "string" ? w : JSON.stringify(w)));
  const budgetBytes = getState().deviceMemoryGib * GIB;
  const scale = Math.max(budgetBytes, ...devices.map((d) => Number(d.total ?? d.total_bytes ?? 0)), 1);
  const used = [...new Set(models.flatMap((m) => parts(m).map(([k]) => k)))];
  return (
    <div data-testid="memory">
      {warnings.map((w) => (
        <div class="alert warn" data-testid="memory-warning">{w}</div>
      ))}
      <div class="legend">
        {used.map((k, i) => (
          <span><i style={{ background: colorOf(k, i) }} />{k.replace(/_/g, " ")}</span>
        ))}
      </div>
      <h3>Per model</h3>
      <div class="mem-bars" data-testid="memory-models">
        {models.map((m) => {
          const items = parts(m);
          const total = items.reduce((a, [, v]) => a + v, 0);
          return (
            <div class="mem-row" data-testid={`memory-model-${m.role ?? m.name}`}>
              <div>
                <b>{m.role ?? m.name}</b> <span class="muted small">{m.device ?? ""}{m.trainable === false ? " · frozen" : ""}</span>
              </div>
              <Bar items={items} scale={scale} />
              <div class="mono">{gib(total)}</div>
            </div>
          );
        })}
      </div>
      <h3 style={{ marginTop: "16px" }}>Per device</h3>
      <div class="mem-bars" data-testid="memory-devices">
        {devices.map((d) => {
          const total = Number(d.total ?? d.total_bytes ?? 0);
          const budget = Number(d.budget ?? d.budget_bytes ?? budgetBytes);
          const over = total > budget;
          return (
            <div class="mem-row" data-testid={`memory-device-${d.device}`} data-over={String(over)}>
              <div><b>{d.device}</b></div>
              <Bar items={[["total", total]]} scale={scale} budget={budget} />
              <div class={`mono${over ? " over" : ""}`}>{gib(total)} / {gib(budget)}</div>
            </div>
          );
        })}
      </div>
      <Recommendation estimate={estimate} />
    </div>
  );
}

function Recommendation({ estimate }: { estimate: Dict }) {
  const rec = estimate.recommendation;
  const prop: Dict | undefined = estimate.budget ?? estimate.proposal ?? estimate.budget_proposal;
  const apply = () => {
    if (!prop) return;
    let config = getState().config;
    for (const [path, value] of Object.entries(prop.config ?? prop.settings ?? {})) config = setPath(config, path, value);
    update({ config });
  };
  return (
    <div class="proposal-wrap">
      {rec && (
        <div class="alert ok" data-testid="memory-recommendation" style={{ marginTop: "14px" }}>
          {typeof rec === "string" ? rec : rec.text ?? rec.summary ?? `${rec.backend ?? ""} ${rec.reason ?? ""}`}
        </div>
      )}
      {prop && (
        <div data-testid="memory-proposal">
          <div class="proposal">
            {Object.entries(prop)
              .filter(([, v]) => typeof v === "number" || typeof v === "string")
              .map(([k, v]) => (
                <div class="stat">
                  <div class="muted small">{k.replace(/_/g, " ")}</div>
                  <div class="v">{String(v)}</div>
                </div>
              ))}
          </div>
          {(prop.config || prop.settings) && (
            <button class="btn" style={{ marginTop: "10px" }} onClick={apply} data-testid="memory-apply">Apply to the config</button>
          )}
        </div>
      )}
    </div>
  );
}
