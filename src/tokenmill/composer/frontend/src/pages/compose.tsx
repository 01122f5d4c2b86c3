// Compose: mode, preset, disclosure level, the schema's fields grouped by section, live validation,
// YAML export (exactly what `tokenmill train` accepts) and import.
import { useEffect, useState } from "preact/hooks";
import { api, ApiError } from "../api";
import type { Config, ExportedFile, FieldError, Level, Mode, Preset, RewardDraft, Schema, SchemaField } from "../api";
import { Field } from "../components/field";
import { getPath, getState, setPath, update, useStore } from "../store";

export const MODE_TITLES: Record<Mode, string> = {
  rl: "Online RL",
  preference: "Offline preference",
  reward_model: "Reward modelling",
  sft: "SFT",
};
const MODE_HELP: Record<Mode, string> = {
  rl: "Sample completions, score them with rewards, and update the policy (GRPO, RLOO, PPO, ...).",
  preference: "Learn from chosen / rejected pairs without sampling (DPO, IPO, SimPO).",
  reward_model: "Train a Bradley-Terry scalar reward model on preference pairs.",
  sft: "Supervised fine-tuning on prompt / completion pairs or chat conversations.",
};
const LEVELS: Level[] = ["simple", "advanced", "expert"];
const schemaCache = new Map<Mode, Schema>();
const configByMode = new Map<Mode, Config>(); // switching modes and back keeps each mode's edits

export async function loadSchema(mode: Mode): Promise<Schema> {
  const hit = schemaCache.get(mode);
  if (hit) return hit;
  const schema = await api.schema(mode);
  schemaCache.set(mode, schema);
  return schema;
}

export function setMode(mode: Mode): void {
  const s = getState();
  if (mode === s.mode) return;
  configByMode.set(s.mode, s.config);
  update({ mode, config: configByMode.get(mode) ?? {}, presetId: null });
}

export function applyPreset(preset: Preset): void {
  update({
    mode: preset.mode,
    config: structuredClone(preset.config),
    presetId: preset.id,
    deviceMemoryGib: preset.device_memory_gib,
    numDevices: preset.num_devices,
  });
}

function Segmented<T extends string>(props: {
  options: T[];
  value: T;
  label: (v: T) => string;
  onPick: (v: T) => void;
  testPrefix: string;
}) {
  return (
    <div class="segmented" role="tablist">
      {props.options.map((opt) => (
        <button
          class={opt === props.value ? "active" : ""}
          data-testid={`${props.testPrefix}-${opt}`}
          aria-pressed={opt === props.value}
          onClick={() => props.onPick(opt)}
        >
          {props.label(opt)}
        </button>
      ))}
    </div>
  );
}

function Presets({ presets, current }: { presets: Preset[]; current: string | null }) {
  return (
    <div class="preset-grid">
      {presets.map((p) => (
        <button
          class={`preset${p.id === current ? " active" : ""}`}
          data-testid={`preset-${p.id}`}
          onClick={() => applyPreset(p)}
        >
          <strong>{p.title}</strong>
          <span class="muted">
            {p.num_devices > 1 ? `${p.num_devices} x ` : ""}
            {p.device_memory_gib} GiB · {MODE_TITLES[p.mode] ?? p.mode}
          </span>
          {p.description && <span class="help">{p.description}</span>}
          {p.model_source && (
            <span class={`small${p.local ? "" : " muted"}`} data-testid={`preset-source-${p.id}`}>
              model: {p.model_source}
            </span>
          )}
        </button>
      ))}
    </div>
  );
}

/** Validate the config a moment after the last edit; errors come back keyed by field path. */
export function useValidation(mode: Mode, config: Config): { errors: FieldError[]; ok: boolean | null } {
  const [result, setResult] = useState<{ errors: FieldError[]; ok: boolean | null }>({ errors: [], ok: null });
  useEffect(() => {
    let live = true;
    const timer = setTimeout(() => {
      api
        .validate(mode, config)
        .then((v) => live && setResult({ errors: v.errors ?? [], ok: v.ok }))
        .catch((e: ApiError) => live && setResult({ errors: [{ path: "", message: e.message }], ok: false }));
    }, 250);
    return () => {
      live = false;
      clearTimeout(timer);
    };
  }, [mode, JSON.stringify(config)]);
  return result;
}

/** The fields shown at `level`, minus those edited elsewhere (rewards) and those of sections turned off. */
function shownFields(schema: Schema, level: Level, config: Config) {
  const rank = LEVELS.indexOf(level);
  return schema.fields.filter(
    (f) =>
      LEVELS.indexOf(f.level) <= rank &&
      f.items !== "reward" &&
      (!f.optional_section || getPath(config, f.optional_section) !== undefined),
  );
}

function SectionToggle({ section, config }: { section: string; config: Config }) {
  const on = getPath(config, section) !== undefined && getPath(config, section) !== null;
  return (
    <label class="switch" title={`Send the optional '${section}' section (an empty one is invalid).`}>
      <input
        type="checkbox"
        data-testid={`section-${section}`}
        checked={on}
        onChange={(e) =>
          update({ config: setPath(getState().config, section, (e.target as HTMLInputElement).checked ? {} : undefined) })
        }
      />
      <span>use {section}</span>
    </label>
  );
}

function Fields({ schema, level, config, errors }: { schema: Schema; level: Level; config: Config; errors: FieldError[] }) {
  const shown = shownFields(schema, level, config);
  const rank = LEVELS.indexOf(level);
  const sections = [...new Set(schema.fields.filter((f) => f.optional_section && LEVELS.indexOf(f.level) <= rank).map((f) => f.optional_section!))];
  const groups = new Map<string, SchemaField[]>();
  (schema.groups ?? []).forEach((g) => groups.set(g.id, []));
  shown.forEach((f) => groups.set(f.group, [...(groups.get(f.group) ?? []), f]));
  sections.forEach((sec) => groups.has(sec) || groups.set(sec, []));
  const meta = new Map((schema.groups ?? []).map((g) => [g.id, g]));
  const byPath = new Map(errors.map((e) => [e.path, e.message]));
  return (
    <div data-testid="fields">
      {[...groups.entries()]
        .filter(([group, fields]) => fields.length > 0 || sections.includes(group))
        .map(([group, fields]) => (
          <section class="group" key={group} data-testid={`group-${group}`}>
            <div class="group-head">
              <h3>{meta.get(group)?.title ?? group}</h3>
              {sections.includes(group) && <SectionToggle section={group} config={config} />}
            </div>
            {meta.get(group)?.description && <p class="help">{meta.get(group)!.description}</p>}
            <div class="field-grid">
              {fields.map((f) => (
                <Field
                  key={f.path}
                  field={f}
                  value={getPath(config, f.path)}
                  error={byPath.get(f.path)}
                  onChange={(v) => update({ config: setPath(getState().config, f.path, v) })}
                />
              ))}
            </div>
          </section>
        ))}
      <p class="muted small">
        {shown.length} of {schema.fields.length} fields shown at the {level} level.
      </p>
    </div>
  );
}

function saveFile(name: string, text: string, type: string): void {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = Object.assign(document.createElement("a"), { href: url, download: name });
  a.click();
  URL.revokeObjectURL(url);
}

function YamlPanel({ mode, config, rewards }: { mode: Mode; config: Config; rewards: RewardDraft[] }) {
  const [yaml, setYaml] = useState("");
  const [filename, setFilename] = useState(`${mode}.yaml`);
  const [files, setFiles] = useState<ExportedFile[]>([]);
  const [exportedFrom, setExportedFrom] = useState("");
  const [incoming, setIncoming] = useState("");
  const [message, setMessage] = useState<{ text: string; bad: boolean } | null>(null);
  const codeRewards = mode === "rl" ? rewards : [];
  const current = JSON.stringify([mode, config, codeRewards]);
  const doExport = async () => {
    try {
      const out = await api.exportYaml(mode, config, codeRewards);
      setYaml(out.yaml);
      setFilename(out.filename || `${mode}.yaml`);
      setFiles(out.files ?? []);
      setExportedFrom(current);
      const beside = out.files?.length ? ` (save the reward files beside ${out.filename} and run it from that folder)` : "";
      setMessage({ text: `Run it with: ${out.command}${beside}`, bad: false });
    } catch (e) {
      setMessage({ text: (e as Error).message, bad: true });
    }
  };
  const doImport = async (text: string) => {
    try {
      const out = await api.importYaml(text, rewards);
      update({ mode: out.mode, config: out.config, presetId: null });
      const errs = out.errors ?? [];
      setMessage({
        text: errs.length ? errs.map((e) => `${e.path || "yaml"}: ${e.message}`).join("\n") : `Imported a ${MODE_TITLES[out.mode]} config.`,
        bad: errs.length > 0,
      });
    } catch (e) {
      setMessage({ text: (e as Error).message, bad: true });
    }
  };
  const download = () => saveFile(filename, yaml, "text/yaml");
  const stale = yaml !== "" && exportedFrom !== current;
  return (
    <div class="yaml-panel">
      <div>
        <div class="row">
          <button class="btn primary" data-testid="export-yaml" onClick={doExport}>
            Export YAML
          </button>
          <button class="btn" disabled={!yaml} onClick={download} data-testid="download-yaml">
            Download
          </button>
          <button class="btn" disabled={!yaml} onClick={() => navigator.clipboard?.writeText(yaml)}>
            Copy
          </button>
        </div>
        {stale && (
          <div class="alert warn" data-testid="yaml-stale">
            The config or the rewards changed since this export: export again.
          </div>
        )}
        <pre class="code" data-testid="yaml-output">{yaml || "Export to see the YAML that `tokenmill train` accepts."}</pre>
        {files.length > 0 && (
          <ul class="file-list" data-testid="export-files">
            {files.map((f) => (
              <li>
                <span class="mono small">{f.path}</span>{" "}
                <button class="btn small" data-testid={`export-file-${f.path}`} data-content={f.content}
                  onClick={() => saveFile(f.path.split("/").pop() ?? f.path, f.content, "text/x-python")}>
                  Download
                </button>
              </li>
            ))}
          </ul>
        )}
      </div>
      <div>
        <div class="row">
          <button class="btn" data-testid="import-yaml" disabled={!incoming.trim()} onClick={() => doImport(incoming)}>
            Import YAML
          </button>
          <label class="btn">
            Open file…
            <input
              type="file"
              accept=".yaml,.yml"
              aria-label="YAML file to import"
              hidden
              onChange={async (e) => {
                const file = (e.target as HTMLInputElement).files?.[0];
                if (file) doImport(await file.text());
              }}
            />
          </label>
        </div>
        <textarea
          class="input mono code"
          rows={12}
          data-testid="yaml-input"
          aria-label="YAML to import"
          placeholder="Paste an existing config YAML here"
          value={incoming}
          onInput={(e) => setIncoming((e.target as HTMLTextAreaElement).value)}
        />
      </div>
      {message && (
        <div class={message.bad ? "alert error" : "alert ok"} data-testid="yaml-message">
          {message.text}
        </div>
      )}
    </div>
  );
}

export function ComposePage() {
  const s = useStore();
  const [presets, setPresets] = useState<Preset[]>([]);
  const [schema, setSchema] = useState<Schema | null>(null);
  const [loadError, setLoadError] = useState<string | null>(null);
  // an answer for a mode left meanwhile is dropped: a slow RL schema must not replace the next mode's form
  useEffect(() => {
    let live = true;
    api.presets(s.mode).then((p) => live && setPresets(p), (e) => live && setLoadError(e.message));
    return () => {
      live = false;
    };
  }, [s.mode]);
  useEffect(() => {
    let live = true;
    setSchema(null);
    loadSchema(s.mode).then((x) => live && setSchema(x), (e) => live && setLoadError(e.message));
    return () => {
      live = false;
    };
  }, [s.mode]);
  const validation = useValidation(s.mode, s.config);
  // errors on fields not on screen (another level, a whole section, "config") are listed above the form
  const onScreen = new Set(schema ? shownFields(schema, s.level, s.config).map((f) => f.path) : []);
  const stray = validation.errors.filter((e) => !onScreen.has(e.path));
  const modes = (schema?.modes.map((m) => m.id) ?? ["rl", "preference", "reward_model", "sft"]) as Mode[];
  return (
    <div class="page" data-testid="page-compose">
      <header class="page-head">
        <div>
          <h1>Compose</h1>
          <p class="muted">Pick what to train, start from a preset, then adjust. Every field's help comes from the config schema.</p>
        </div>
        <span
          class={`badge ${validation.ok === null ? "" : validation.ok ? "ok" : "bad"}`}
          data-testid="validation-status"
        >
          {validation.ok === null ? "checking…" : validation.ok ? "valid" : `${validation.errors.length} problem(s)`}
        </span>
      </header>
      {loadError && <div class="alert error">{loadError}</div>}
      <div class="card">
        <h2>Mode</h2>
        <Segmented options={modes} value={s.mode} label={(m) => MODE_TITLES[m] ?? m} onPick={setMode} testPrefix="mode" />
        <p class="help">{MODE_HELP[s.mode]}</p>
      </div>
      <div class="card">
        <h2>Presets</h2>
        <Presets presets={presets} current={s.presetId} />
      </div>
      <div class="card">
        <div class="card-head">
          <h2>Options</h2>
          <Segmented options={LEVELS} value={s.level} label={(l) => l} onPick={(level) => update({ level })} testPrefix="level" />
        </div>
        {stray.length > 0 && (
          <div class="alert error" data-testid="validation-errors">
            {stray.map((e) => (
              <div>
                <span class="mono">{e.path || "config"}</span>: {e.message}
              </div>
            ))}
          </div>
        )}
        {schema ? <Fields schema={schema} level={s.level} config={s.config} errors={validation.errors} /> : <p class="muted">Loading the schema…</p>}
      </div>
      <div class="card">
        <h2>YAML</h2>
        <YamlPanel mode={s.mode} config={s.config} rewards={s.rewards} />
      </div>
    </div>
  );
}
