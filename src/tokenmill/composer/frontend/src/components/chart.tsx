// A uPlot line chart of one or more metric series against the step; redrawn in place on new points.
// Axis titles (with the unit), optional exponential smoothing (the raw curve stays, faint), zoom by dragging
// across the plot (a double click zooms back out), and a legend that shows each series' value: the last one,
// or the one under the cursor.
import { useEffect, useRef, useState } from "preact/hooks";
import uPlot from "uplot";

export interface Series {
  label: string;
  values: (number | null)[];
  color: string;
}

/** Exponential moving average (TensorBoard's smoothing, debiased), skipping missing points. */
export function smooth(values: (number | null)[], weight: number): (number | null)[] {
  if (weight <= 0) return values;
  let avg = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null) return null;
    avg = avg * weight + (1 - weight) * v;
    n += 1;
    return avg / (1 - weight ** n);
  });
}

/** Curves sampled at different steps on one x axis: the union of the steps, null where a curve has none. */
export function align(curves: [number, number][][]): { steps: number[]; values: (number | null)[][] } {
  const steps = [...new Set(curves.flatMap((c) => c.map((p) => p[0])))].sort((a, b) => a - b);
  const at = new Map(steps.map((s, i) => [s, i]));
  const values = curves.map((c) => {
    const row: (number | null)[] = steps.map(() => null);
    c.forEach(([s, v]) => (row[at.get(s)!] = v));
    return row;
  });
  return { steps, values };
}

/** The y range: uPlot's own, except for a (nearly) constant series, such as a fixed learning rate or a ratio
 * of 1.0000001, where its tick loop cannot step (the increment rounds away) and overflows an array ("Invalid
 * array length"): such a range is widened to at least a thousandth of the values' magnitude. */
function yRange(_u: uPlot, min: number | null, max: number | null): [number, number] {
  if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  const mag = Math.max(Math.abs(min), Math.abs(max));
  if (max - min <= mag * 1e-6) {
    const pad = mag * 0.1 || 1;
    return [min - pad, max + pad];
  }
  if (max - min < mag * 1e-3) return [min - mag * 1e-3, max + mag * 1e-3];
  return uPlot.rangeNum(min, max, 0.1, true) as [number, number];
}

const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000];

function faint(color: string): string {
  return `${color}55`;
}

export function LineChart(props: {
  title: string;
  steps: number[];
  series: Series[];
  testId: string;
  note?: string;
  unit?: string;
  smoothing?: number;
  /** The x axis' title ("step" unless the x values are something else: wall time, tokens). */
  xLabel?: string;
  /** Called with the x value of the point clicked (the nearest one to the cursor); a drag still zooms. */
  onPick?: (x: number) => void;
}) {
  const host = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const [hover, setHover] = useState<number | null>(null);
  const [zoomed, setZoomed] = useState(false);
  const weight = props.smoothing ?? 0;
  const shown = props.series.map((s) => ({ ...s, values: smooth(s.values, weight) }));
  const data = () =>
    [props.steps, ...shown.map((s) => s.values), ...(weight > 0 ? props.series.map((s) => s.values) : [])] as uPlot.AlignedData;
  const yLabel = props.unit ? `${props.title} (${props.unit})` : props.title;
  const xLabel = props.xLabel ?? "step";
  const key = `${props.series.map((s) => s.label).join("|")}:${weight > 0}:${xLabel}`;
  const onPick = useRef(props.onPick);
  onPick.current = props.onPick;
  useEffect(() => {
    const el = host.current!;
    const lines = shown.map((s) => ({ label: s.label, stroke: s.color, width: 2, spanGaps: true, points: { size: 5 } }));
    const raw = weight > 0 ? props.series.map((s) => ({ label: `${s.label} (raw)`, stroke: faint(s.color), width: 1, spanGaps: true, points: { show: false } })) : [];
    const axis = { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e5e7eb" }, labelSize: 18, font: "11px system-ui", labelFont: "12px system-ui" };
    const opts: uPlot.Options = {
      width: Math.max(260, el.clientWidth || 360),
      height: 180,
      legend: { show: false },
      cursor: { drag: { x: true, y: false, setScale: true } },
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        xLabel === "step" ? { ...axis, label: "step", incrs: STEP_INCRS } : { ...axis, label: xLabel },
        { ...axis, size: 52, label: props.unit || props.title }, // the card's head names the chart: the axis its unit
      ],
      series: [{ label: xLabel }, ...lines, ...raw],
      hooks: {
        setCursor: [(u) => setHover(u.cursor.idx ?? null)],
        setScale: [
          (u, scale) => {
            if (scale !== "x") return;
            const xs = u.data[0] as number[];
            const min = u.scales.x.min ?? 0;
            const max = u.scales.x.max ?? 0;
            setZoomed(xs.length > 1 && (min > xs[0] || max < xs[xs.length - 1]));
          },
        ],
      },
    };
    plot.current = new uPlot(opts, data(), el);
    // a click (no drag) on the plot picks the point under the cursor
    let down: number | null = null;
    const over = plot.current.over;
    over.addEventListener("mousedown", (e) => (down = e.clientX));
    over.addEventListener("click", (e) => {
      const u = plot.current;
      const idx = u?.cursor.idx;
      if (!u || !onPick.current || down === null || Math.abs(e.clientX - down) > 3 || idx == null) return;
      onPick.current((u.data[0] as number[])[idx]);
    });
    const resize = new ResizeObserver(() => plot.current?.setSize({ width: Math.max(260, el.clientWidth), height: 180 }));
    resize.observe(el);
    return () => {
      resize.disconnect();
      plot.current?.destroy();
    };
  }, [key]);
  useEffect(() => {
    plot.current?.setData(data(), !zoomed); // keep a zoom while points arrive
  });
  const valueAt = (values: (number | null)[]) => {
    if (hover !== null && hover < values.length) return values[hover];
    return values.filter((v) => v !== null).slice(-1)[0] ?? null;
  };
  const first = valueAt(shown[0]?.values ?? []);
  return (
    <div class={`chart card${props.onPick ? " pickable" : ""}`} data-testid={props.testId} data-points={props.steps.length} data-zoomed={String(zoomed)}>
      <div class="chart-head">
        <h3>{props.title}</h3>
        <span class="mono">{props.note ?? (first === null ? "—" : formatNumber(first))}</span>
      </div>
      <div ref={host} class="chart-body" role="img" aria-label={`${yLabel} against ${xLabel}`} />
      <div class="chart-legend" data-testid={`${props.testId}-legend`}>
        {hover !== null && props.steps[hover] !== undefined && <span class="muted">{xLabel} {formatNumber(props.steps[hover])}</span>}
        {shown.map((s) => {
          const v = valueAt(s.values);
          return (
            <span data-label={s.label} data-value={v === null ? "" : String(v)}>
              <i style={{ background: s.color }} />
              {s.label} <b class="mono">{v === null ? "—" : formatNumber(v)}</b>
            </span>
          );
        })}
        {zoomed && <span class="muted">zoomed: double-click to reset</span>}
      </div>
      {props.note && props.series.every((x) => x.values.every((v) => v === null || v === 0)) && (
        <div class="chart-off">{props.note}</div>
      )}
    </div>
  );
}

export function formatSeconds(s: number): string {
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
  return `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

export function formatDuration(s: number): string {
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

export function formatNumber(v: number): string {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return Number.isInteger(v) ? String(v) : v.toFixed(a < 1 ? 4 : 2);
}

/** A smoothing slider for the charts of a page (0 = raw). */
export function SmoothingControl(props: { value: number; onChange: (v: number) => void }) {
  return (
    <label class="inline" title="Exponential moving average of each curve; the raw curve stays, faint.">
      <span class="muted small">smoothing</span>
      <input type="range" min={0} max={0.95} step={0.05} value={props.value} data-testid="smoothing"
        onInput={(e) => props.onChange(Number((e.target as HTMLInputElement).value))} />
      <span class="mono small">{props.value.toFixed(2)}</span>
    </label>
  );
}
