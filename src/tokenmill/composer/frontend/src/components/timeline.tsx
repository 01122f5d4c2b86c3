// The efficiency view: the recent steps as one bar each, split into the time of each stage the trainer
// timed (generate, reward, critic, train, sync) and the idle rest of the step; for an async run, the staleness
// of the batch each step trained on; and the run's own health alarms at the step they fired.
import type { Alarm } from "../api";
import { formatSeconds } from "./chart";
import type { Row } from "./runpanels";

export const TIMELINE_STEPS = 30;
const STAGES = ["generate", "reward", "critic", "train", "sync"];
const COLORS: Record<string, string> = { generate: "#2563eb", reward: "#16a34a", critic: "#7c3aed", train: "#ea580c",
  sync: "#0891b2", idle: "#e5e7eb" };

function num(row: Row, key: string): number | null {
  const v = row[key];
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

/** One step's parts in seconds: each timed stage, and `idle`, the step's time no stage accounts for (none when
 * the stages overlap, as an async run's producer and trainer do). */
export function stepParts(row: Row): { parts: [string, number][]; total: number } {
  const parts = STAGES.map((s): [string, number] => [s, num(row, `timing_s/${s}`) ?? 0]).filter(([, v]) => v > 0);
  const timed = parts.reduce((a, [, v]) => a + v, 0);
  const step = num(row, "timing_s/step") ?? timed;
  if (step > timed) parts.push(["idle", step - timed]);
  return { parts, total: Math.max(step, timed) };
}

export function Timeline({ rows, alarms }: { rows: Row[]; alarms: Alarm[] }) {
  // steps whose stages the trainer timed (a bare step time would be one bar of "idle")
  const recent = rows.filter((r) => STAGES.some((s) => num(r, `timing_s/${s}`) !== null)).slice(-TIMELINE_STEPS);
  if (recent.length === 0) return null;
  const steps = recent.map((r) => ({ row: r, ...stepParts(r) }));
  const longest = Math.max(...steps.map((s) => s.total), 1e-9);
  const asyncRun = recent.some((r) => num(r, "async/staleness_mean") !== null);
  const alarmsAt = new Map<number, Alarm[]>();
  alarms.forEach((a) => alarmsAt.set(a.step, [...(alarmsAt.get(a.step) ?? []), a]));
  const used = new Set(steps.flatMap((s) => s.parts.map(([p]) => p)));
  return (
    <div class="card" data-testid="timeline">
      <div class="card-head">
        <h2>Efficiency: the last {recent.length} step(s)</h2>
        <div class="legend">
          {[...STAGES, "idle"].filter((p) => used.has(p)).map((p) => (
            <span><i style={{ background: COLORS[p] }} />{p}</span>
          ))}
          {asyncRun && <span class="muted">staleness: policy versions behind the trainer</span>}
        </div>
      </div>
      <div class="timeline">
        {steps.map(({ row, parts, total }) => {
          const step = num(row, "step") ?? 0;
          const fired = alarmsAt.get(step) ?? [];
          const stale = num(row, "async/staleness_mean");
          return (
            <div class="timeline-row" data-testid={`timeline-step-${step}`} data-total={total.toFixed(3)}
              data-parts={parts.map(([p, v]) => `${p}:${v.toFixed(3)}`).join(",")} data-staleness={stale ?? ""}
              data-alarms={fired.map((a) => a.name).join(",")}>
              <span class="mono small">{step}</span>
              <div class="timeline-bar" role="img" aria-label={`step ${step}: ${parts.map(([p, v]) => `${p} ${formatSeconds(v)}`).join(", ")}`}>
                {parts.map(([p, v]) => (
                  <div title={`${p} ${formatSeconds(v)}`} style={{ width: `${(100 * v) / longest}%`, background: COLORS[p] }} />
                ))}
              </div>
              <span class="mono small">{formatSeconds(total)}</span>
              {asyncRun && <span class="mono small stale" title="mean staleness of the batch trained on">{stale === null ? "—" : `staleness ${stale.toFixed(1)}`}</span>}
              {fired.length > 0 && (
                <span class="timeline-alarm" title={fired.map((a) => `${a.name}: ${a.message}`).join("\n")}>⚠ {fired.map((a) => a.name).join(", ")}</span>
              )}
            </div>
          );
        })}
      </div>
    </div>
  );
}
