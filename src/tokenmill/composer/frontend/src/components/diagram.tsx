// The four models (actor, critic, reward, reference) and the data flow between generator and trainer,
// hand-written SVG: active models solid, inactive ones dashed and grey, each with its device.
import type { Diagram, DiagramModel } from "../api";

interface Box {
  x: number;
  y: number;
  w: number;
  h: number;
}

const W = 176;
const H = 74;
// Fixed places for the nodes the backend names; anything else goes on the bottom row.
const PLACES: Record<string, [number, number]> = {
  data: [16, 128],
  generator: [216, 24],
  actor: [446, 24],
  trainer: [676, 24],
  reward: [216, 232],
  reference: [446, 232],
  critic: [676, 232],
};
const ROLE_TITLES: Record<string, string> = {
  actor: "Actor (policy)",
  critic: "Critic (value)",
  reward: "Reward",
  reference: "Reference",
  generator: "Generator",
  trainer: "Trainer",
  data: "Prompts",
};
const STAGE_NOTES: Record<string, string> = {
  generator: "rollout engine",
  trainer: "losses · optimiser",
  data: "dataset / env",
};

function place(id: string, extra: string[]): Box {
  const fixed = PLACES[id];
  if (fixed) return { x: fixed[0], y: fixed[1], w: W, h: H };
  const i = extra.indexOf(id);
  return { x: 16 + i * (W + 20), y: 336, w: W, h: H };
}

/** Where the segment from a's centre to b's centre leaves box a. */
function edgePoint(a: Box, b: Box): [number, number] {
  const ax = a.x + a.w / 2, ay = a.y + a.h / 2;
  const dx = b.x + b.w / 2 - ax, dy = b.y + b.h / 2 - ay;
  const t = Math.min(Math.abs(a.w / 2 / (dx || 1e-9)), Math.abs(a.h / 2 / (dy || 1e-9)));
  return [ax + dx * t, ay + dy * t];
}

function ModelBox({ box, model }: { box: Box; model: DiagramModel }) {
  const cls = `node model ${model.active ? "active" : "inactive"} ${model.trainable ? "trainable" : "frozen"}`;
  return (
    <g class={cls} data-testid={`diagram-${model.role}`} data-active={String(model.active)} data-device={model.device}>
      <title>{model.why}</title>
      <rect x={box.x} y={box.y} width={box.w} height={box.h} rx={10} />
      <text x={box.x + 12} y={box.y + 22} class="node-title">
        {ROLE_TITLES[model.role] ?? model.role}
      </text>
      <text x={box.x + 12} y={box.y + 40} class="node-sub">
        {model.active ? (model.trainable ? "trained" : "frozen") : "not used"}
        {model.name ? ` · ${model.name.length > 14 ? model.name.slice(0, 13) + "…" : model.name}` : ""}
      </text>
      {model.active && (
        <g class="device-tag">
          <rect x={box.x + 12} y={box.y + 48} width={Math.max(44, model.device.length * 7.2 + 14)} height={18} rx={9} />
          <text x={box.x + 19} y={box.y + 61}>
            {model.device}
          </text>
        </g>
      )}
    </g>
  );
}

function StageBox({ box, id }: { box: Box; id: string }) {
  return (
    <g class="node stage" data-testid={`diagram-${id}`}>
      <rect x={box.x} y={box.y} width={box.w} height={box.h} rx={10} />
      <text x={box.x + 12} y={box.y + 30} class="node-title">
        {ROLE_TITLES[id] ?? id}
      </text>
      <text x={box.x + 12} y={box.y + 50} class="node-sub">
        {STAGE_NOTES[id] ?? ""}
      </text>
    </g>
  );
}

export function ModelsDiagram({ diagram }: { diagram: Diagram }) {
  const roles = new Map(diagram.models.map((m) => [m.role as string, m]));
  const ids = new Set<string>([...roles.keys()]);
  diagram.flows.forEach((f) => ids.add(f.from).add(f.to));
  const extra = [...ids].filter((id) => !PLACES[id]);
  const boxes = new Map([...ids].map((id) => [id, place(id, extra)]));
  const height = extra.length ? 420 : 320;
  const activeIds = new Set([...roles.values()].filter((m) => m.active).map((m) => m.role as string));
  return (
    <svg class="diagram" viewBox={`0 0 868 ${height}`} role="img" aria-label="models and data flow" data-testid="models-diagram">
      <defs>
        <marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
          <path d="M 0 0 L 10 5 L 0 10 z" />
        </marker>
      </defs>
      {diagram.flows.map((f, i) => {
        const a = boxes.get(f.from)!, b = boxes.get(f.to)!;
        const [x1, y1] = edgePoint(a, b);
        const [x2, y2] = edgePoint(b, a);
        const live = (!roles.has(f.from) || activeIds.has(f.from)) && (!roles.has(f.to) || activeIds.has(f.to));
        const mx = (x1 + x2) / 2, my = (y1 + y2) / 2;
        return (
          <g class={`flow ${live ? "live" : "off"}`} data-testid={`flow-${i}`}>
            <line x1={x1} y1={y1} x2={x2} y2={y2} marker-end="url(#arrow)" />
            <rect x={mx - f.label.length * 3.3 - 6} y={my - 10} width={f.label.length * 6.6 + 12} height={18} rx={4} class="flow-label-bg" />
            <text x={mx} y={my + 3} text-anchor="middle" class="flow-label">
              {f.label}
            </text>
          </g>
        );
      })}
      {[...boxes.entries()].map(([id, box]) => {
        const model = roles.get(id);
        return model ? <ModelBox box={box} model={model} /> : <StageBox box={box} id={id} />;
      })}
    </svg>
  );
}
