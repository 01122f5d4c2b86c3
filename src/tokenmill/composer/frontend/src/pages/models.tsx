// Models & memory: which of the four models exist for this config and where they live (diagram),
// and the memory each needs per device, with warnings, a backend recommendation and a budget slider.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Config, Diagram } from "../api";
import { ModelsDiagram } from "../components/diagram";
import { MemoryPanel } from "../components/memory";
import { getPath, update, useStore } from "../store";

/** What the non-model boxes say: where generation runs, what the trainer does, where data comes from. */
function stageNotes(mode: string, config: Config): Record<string, string> {
  const placement = String(getPath(config, "engine.placement") ?? "colocated");
  const servers = getPath(config, "engine.num_servers");
  const task = getPath(config, "data.task") ?? getPath(config, "data.path") ?? getPath(config, "env.name");
  return {
    data: task ? String(task) : "dataset",
    generator: placement === "colocated" ? "in-process engine" : `${placement} engine${servers ? ` x ${servers}` : ""}`,
    trainer: mode === "rl" ? "advantages, loss" : "loss, AdamW",
  };
}

export function ModelsPage() {
  const s = useStore();
  const [diagram, setDiagram] = useState<Diagram | null>(null);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    let live = true;
    api.diagram(s.mode, s.config).then(
      (d) => live && (setDiagram(d), setError(null)),
      (e) => live && setError(e.message),
    );
    return () => {
      live = false;
    };
  }, [s.mode, JSON.stringify(s.config)]);
  return (
    <div class="page" data-testid="page-models">
      <header class="page-head">
        <div>
          <h1>Models &amp; memory</h1>
          <p class="muted">The four models of RL post-training, the data between generator and trainer, and what each costs.</p>
        </div>
      </header>
      <div class="card">
        <h2>The four models</h2>
        {error && <div class="alert error">{error}</div>}
        {diagram && <ModelsDiagram diagram={diagram} mode={s.mode} notes={stageNotes(s.mode, s.config)} />}
        {diagram && (
          <ul class="why" data-testid="diagram-why">
            {diagram.models.map((m) => (
              <li class={m.active ? "" : "muted"}>
                <b>{m.role}</b>: {m.why}
              </li>
            ))}
          </ul>
        )}
        {(diagram?.errors ?? []).map((e) => (
          <div class="alert error">
            <span class="mono">{e.path}</span>: {e.message}
          </div>
        ))}
      </div>
      <div class="card">
        <div class="card-head">
          <h2>Memory</h2>
          <div class="row">
            <label class="inline" title="Memory of one device (GPU, or the machine's RAM on CPU).">
              <span class="muted small">GiB per device</span>
              <input class="input narrow" type="number" min={1} step="any" value={s.deviceMemoryGib} data-testid="device-memory"
                onChange={(e) => update({ deviceMemoryGib: Number((e.target as HTMLInputElement).value) || 1 })} />
            </label>
            <label class="inline">
              <span class="muted small">devices</span>
              <input class="input narrow" type="number" min={1} step={1} value={s.numDevices} data-testid="num-devices"
                onChange={(e) => update({ numDevices: Math.max(1, Math.round(Number((e.target as HTMLInputElement).value) || 1)) })} />
            </label>
          </div>
        </div>
        <MemoryPanel />
      </div>
    </div>
  );
}
