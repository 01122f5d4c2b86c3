// A uPlot line chart of one or more metric series against the step; redrawn in place on new points.
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";

export interface Series {
  label: string;
  values: (number | null)[];
  color: string;
}

export function LineChart(props: { title: string; steps: number[]; series: Series[]; testId: string; note?: string }) {
  const host = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const labels = props.series.map((s) => s.label).join("|");
  useEffect(() => {
    const el = host.current!;
    const opts: uPlot.Options = {
      width: Math.max(260, el.clientWidth || 360),
      height: 170,
      legend: { show: props.series.length > 1 },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: false } },
      axes: [
        { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e5e7eb" } },
        { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e5e7eb" }, size: 48 },
      ],
      series: [{ label: "step" }, ...props.series.map((s) => ({ label: s.label, stroke: s.color, width: 2, points: { size: 5 } }))],
    };
    plot.current = new uPlot(opts, [props.steps, ...props.series.map((s) => s.values)] as uPlot.AlignedData, el);
    const resize = new ResizeObserver(() => plot.current?.setSize({ width: Math.max(260, el.clientWidth), height: 170 }));
    resize.observe(el);
    return () => {
      resize.disconnect();
      plot.current?.destroy();
    };
  }, [labels]);
  useEffect(() => {
    plot.current?.setData([props.steps, ...props.series.map((s) => s.values)] as uPlot.AlignedData);
  });
  const last = props.series[0]?.values.filter((v) => v !== null).slice(-1)[0];
  return (
    <div class="chart card" data-testid={props.testId} data-points={props.steps.length}>
      <div class="chart-head">
        <h3>{props.title}</h3>
        <span class="mono">{props.note ?? (last === undefined || last === null ? "—" : formatNumber(last))}</span>
      </div>
      <div ref={host} class="chart-body" />
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

export function formatNumber(v: number): string {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return Number.isInteger(v) ? String(v) : v.toFixed(a < 1 ? 4 : 2);
}
