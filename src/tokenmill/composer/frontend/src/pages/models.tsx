// Models & memory: which of the four models exist for this config and where they live (diagram),
// and the memory each needs per device, with warnings, a backend recommendation and a budget slider.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Config, Diagram } from "../api";
import { ModelsDiagram } from "../components/diagram";
import { MemoryPanel } from "../components/memory";
import { ClusterLayout } from "../components/placement";
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

/** A number above 0 (a whole one if `integer`); anything else is named under the box and not applied. */
function PositiveInput(props: { label: string; title?: string; value: number; testId: string; integer?: boolean;
  onValid: (v: number) => void }) {
  const [text, setText] = useState(String(props.value));
  const [bad, setBad] = useState<string | null>(null);
  useEffect(() => {
    if (Number(text) !== props.value) setText(String(props.value)); // set elsewhere: a preset, the slider
  }, [props.value]);
  const check = (raw: string) => {
    setText(raw);
    const v = Number(raw.trim());
    if (raw.trim() === "" || !Number.isFinite(v) || v <= 0 || (props.integer && !Number.isInteger(v))) {
      setBad(`${props.label}: "${raw}" is not ${props.integer ? "a whole number" : "a number"} above 0; the estimate keeps ${props.value}`);
    } else {
      setBad(null);
      props.onValid(v);
    }
  };
  return (
    <label class="inline" title={props.title}>
      <span class="muted small">{props.label}</span>
      <input class="input narrow" type="text" inputMode={props.integer ? "numeric" : "decimal"} value={text}
        data-testid={props.testId} aria-invalid={bad ? "true" : "false"}
        onChange={(e) => check((e.target as HTMLInputElement).value)} />
      {bad && <span class="field-error" data-testid={`${props.testId}-error`}>{bad}</span>}
    </label>
  );
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
            <PositiveInput label="GiB per device" title="Memory of one device (GPU, or the machine's RAM on CPU)."
              value={s.deviceMemoryGib} testId="device-memory" onValid={(v) => update({ deviceMemoryGib: v })} />
            <PositiveInput label="devices" integer value={s.numDevices} testId="num-devices"
              onValid={(v) => update({ numDevices: v })} />
          </div>
        </div>
        <MemoryPanel />
        <ClusterLayout />
      </div>
    </div>
  );
}
