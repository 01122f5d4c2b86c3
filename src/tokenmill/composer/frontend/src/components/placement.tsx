// Where a `cluster: {backend: ray}` config runs each role, from /api/placement (composer/placement.py): the
// planner `tokenmill plan` prints, so the page and the command never disagree. Each node is a card listing
// what sits on each of its devices; a table says where every role runs (driver, with the trainer ranks, a
// group of its own); a layout that does not fit shows the planner's message, which names the field.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import { getPath, useStore } from "../store";

interface Slot {
  role: string;
  index: number;
  name: string;
  device: string;
  cpus: number;
}
interface NodeLayout {
  node: number;
  cpus: number;
  gpus: number;
  free_cpus: number;
  free_gpus: number;
  slots: Slot[];
}
interface PlacementAnswer {
  backend: "ray" | "local";
  message?: string;
  error?: string;
  lines?: string[];
  layout?: { nodes: NodeLayout[]; roles: { role: string; where: string }[] };
}

const ROLE_COLORS: Record<string, string> = {
  trainer: "#2563eb", reference: "#7c3aed", critic: "#db2777", reward_model: "#ca8a04", engine: "#16a34a",
};

function NodeCard({ node }: { node: NodeLayout }) {
  return (
    <div data-testid={`cluster-node-${node.node}`}
      style={{ border: "1px solid #cbd5e1", borderRadius: "6px", padding: "8px", minWidth: "210px" }}>
      <div>
        <b>node {node.node}</b>{" "}
        <span class="muted small">CPU {node.cpus} · GPU {node.gpus}</span>
      </div>
      {node.slots.map((s) => (
        <div data-testid="cluster-slot" data-role={s.role} data-device={s.device} class="small mono"
          style={{ borderLeft: `4px solid ${ROLE_COLORS[s.role] ?? "#94a3b8"}`, paddingLeft: "6px", margin: "3px 0" }}>
          {s.device} · {s.name} · CPU {s.cpus}
        </div>
      ))}
      <div class="muted small" data-testid={`cluster-free-${node.node}`}>
        free: CPU {node.free_cpus}, GPU {node.free_gpus}
      </div>
    </div>
  );
}

export function ClusterLayout() {
  const s = useStore();
  const ray = s.mode === "rl" && getPath(s.config, "cluster.backend") === "ray";
  const [out, setOut] = useState<PlacementAnswer | null>(null);
  useEffect(() => {
    if (!ray) {
      setOut(null);
      return;
    }
    let live = true;
    const timer = setTimeout(() => {
      api.placement(s.mode, s.config).then(
        (answer) => live && setOut(answer as unknown as PlacementAnswer),
        (e) => live && setOut({ backend: "ray", error: e.message }),
      );
    }, 200);
    return () => {
      live = false;
      clearTimeout(timer);
    };
  }, [s.mode, JSON.stringify(s.config)]);
  if (!ray || !out || out.backend !== "ray") return null;
  return (
    <div data-testid="cluster-layout">
      <h3 style={{ marginTop: "14px" }}>Where each role runs</h3>
      {out.error && <div class="alert error" data-testid="cluster-layout-error">{out.error}</div>}
      {(out.lines ?? []).filter((l) => l.startsWith("note: ")).map((l) => (
        <div class="alert warn" data-testid="cluster-layout-note">{l.slice(6)}</div>
      ))}
      {out.layout && (
        <div>
          <table class="table" data-testid="cluster-roles">
            <tbody>
              {out.layout.roles.map((r) => (
                <tr data-testid={`cluster-role-${r.role.replace(/ /g, "_")}`}>
                  <td>{r.role}</td>
                  <td class="small">{r.where}</td>
                </tr>
              ))}
            </tbody>
          </table>
          <div class="row" style={{ flexWrap: "wrap", gap: "8px", marginTop: "8px", alignItems: "flex-start" }}>
            {out.layout.nodes.map((n) => <NodeCard node={n} />)}
          </div>
        </div>
      )}
    </div>
  );
}
