// The four models (actor, critic, reward, reference) and the data flow between generator and trainer,
// hand-written SVG: active models solid, inactive ones dashed and grey, each with its device.
import type { Diagram, DiagramModel } from "../api";

interface Box {
  x: number;
  y: number;
  w: number;
  h: number;
}

const W = 140;
const H = 80;
// The RL loop reads clockwise: prompts -> generator -> reward -> trainer -> actor -> (weight sync) -> generator,
// with the reference and critic feeding the trainer from the right.
const PLACES: Record<string, [number, number]> = {
  data: [12, 24],
  generator: [250, 24],
  reward: [488, 24],
  reference: [726, 24],
  actor: [250, 214],
  trainer: [488, 214],
  critic: [726, 214],
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

export interface Flow {
  from: string;
  to: string;
  label: string;
}

/** The data flow drawn for a mode; which models are on comes from the server (`models[].active`). */
export function flowsFor(mode: string): Flow[] {
  if (mode === "rl") {
    return [
      { from: "data", to: "generator", label: "prompts" },
      { from: "generator", to: "reward", label: "completions" },
      { from: "reward", to: "trainer", label: "rewards → advantages" },
      { from: "reference", to: "trainer", label: "KL (ref log-probs)" },
      { from: "critic", to: "trainer", label: "values (GAE)" },
      { from: "trainer", to: "actor", label: "gradient step" },
      { from: "actor", to: "generator", label: "weight sync" },
    ];
  }
  const target = mode === "reward_model" ? "reward" : "actor";
  return [
    { from: "data", to: "trainer", label: mode === "sft" ? "examples" : "chosen / rejected pairs" },
    { from: "reference", to: "trainer", label: "reference log-probs" },
    { from: "trainer", to: target, label: "gradient step" },
  ];
}

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

function short(name: string | undefined, max = 19): string {
  const last = (name ?? "").split("/").filter(Boolean).slice(-1)[0] ?? "";
  return last.length > max ? last.slice(0, max - 1) + "…" : last;
}

function ModelBox({ box, model }: { box: Box; model: DiagramModel }) {
  const cls = `node model ${model.active ? "active" : "inactive"} ${model.trainable ? "trainable" : "frozen"}`;
  const device = model.device ?? "";
  const tagW = Math.max(40, device.length * 6.8 + 14);
  return (
    <g class={cls} data-testid={`diagram-${model.role}`} data-active={String(model.active)} data-device={device}>
      <title>{`${model.name ? model.name + ": " : ""}${model.why}`}</title>
      <rect x={box.x} y={box.y} width={box.w} height={box.h} rx={10} />
      <text x={box.x + 12} y={box.y + 22} class="node-title">
        {ROLE_TITLES[model.role] ?? model.role}
      </text>
      <text x={box.x + 12} y={box.y + 40} class="node-sub">
        {model.active ? short(model.name) : "not used"}
      </text>
      {model.active && device && (
        <g class="device-tag">
          <rect x={box.x + 12} y={box.y + 52} width={tagW} height={18} rx={9} />
          <text x={box.x + 19} y={box.y + 65}>
            {device}
          </text>
        </g>
      )}
      {model.active && (
        <text x={box.x + 12 + (device ? tagW + 8 : 0)} y={box.y + 65} class="node-sub">
          {model.trainable ? "trained" : "frozen"}
        </text>
      )}
    </g>
  );
}

function StageBox({ box, id, note }: { box: Box; id: string; note: string }) {
  return (
    <g class="node stage" data-testid={`diagram-${id}`}>
      <rect x={box.x} y={box.y} width={box.w} height={box.h} rx={10} />
      <text x={box.x + 12} y={box.y + 30} class="node-title">
        {ROLE_TITLES[id] ?? id}
      </text>
      <text x={box.x + 12} y={box.y + 50} class="node-sub">
        {note}
      </text>
    </g>
  );
}

function ends(a: Box, b: Box): [number, number, number, number] {
  const [x1, y1] = edgePoint(a, b);
  const [x2, y2] = edgePoint(b, a);
  return [x1, y1, x2, y2];
}

/** Labels go above a horizontal arrow, beside a vertical one, and near the start of a diagonal one, drawn
 * after the boxes so that nothing covers them. */
function FlowLabel({ flow, line, live }: { flow: Flow; line: [number, number, number, number]; live: boolean }) {
  const [x1, y1, x2, y2] = line;
  const w = flow.label.length * 6.3 + 10;
  let x = (x1 + x2) / 2, y = (y1 + y2) / 2, anchor: "middle" | "end" = "middle";
  if (Math.abs(y2 - y1) < 1) y -= 12;
  else if (Math.abs(x2 - x1) < 1) (x -= 8), (anchor = "end");
  else (x = x1 + 0.35 * (x2 - x1)), (y = y1 + 0.35 * (y2 - y1)), (anchor = "middle");
  const left = anchor === "end" ? x - w + 5 : x - w / 2;
  return (
    <g class={`flow ${live ? "live" : "off"}`}>
      <rect x={left} y={y - 12} width={w} height={17} rx={4} class="flow-label-bg" />
      <text x={x} y={y + 1} text-anchor={anchor} class="flow-label">
        {flow.label}
      </text>
    </g>
  );
}

/** `notes` label the non-model nodes (data, generator, trainer), e.g. where the engine runs. */
export function ModelsDiagram({ diagram, mode, notes }: { diagram: Diagram; mode: string; notes: Record<string, string> }) {
  const roles = new Map(diagram.models.map((m) => [m.role as string, m]));
  const flows = flowsFor(mode);
  const ids = new Set<string>([...roles.keys()]);
  flows.forEach((f) => ids.add(f.from).add(f.to));
  const extra = [...ids].filter((id) => !PLACES[id]);
  const boxes = new Map([...ids].map((id) => [id, place(id, extra)]));
  const height = extra.length ? 420 : 300;
  const on = (id: string) => !roles.has(id) || roles.get(id)!.active;
  return (
    <svg class="diagram" viewBox={`0 0 882 ${height}`} role="img" aria-label="models and data flow" data-testid="models-diagram">
      <defs>
        <marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
          <path d="M 0 0 L 10 5 L 0 10 z" />
        </marker>
      </defs>
      {flows.map((f) => {
        const [x1, y1, x2, y2] = ends(boxes.get(f.from)!, boxes.get(f.to)!);
        const live = on(f.from) && on(f.to);
        return (
          <g class={`flow ${live ? "live" : "off"}`} data-testid={`flow-${f.from}-${f.to}`} data-live={String(live)}>
            <line x1={x1} y1={y1} x2={x2} y2={y2} marker-end="url(#arrow)" />
          </g>
        );
      })}
      {[...boxes.entries()].map(([id, box]) => {
        const model = roles.get(id);
        return model ? <ModelBox box={box} model={model} /> : <StageBox box={box} id={id} note={notes[id] ?? ""} />;
      })}
      {flows.map((f) => (
        <FlowLabel flow={f} line={ends(boxes.get(f.from)!, boxes.get(f.to)!)} live={on(f.from) && on(f.to)} />
      ))}
    </svg>
  );
}
