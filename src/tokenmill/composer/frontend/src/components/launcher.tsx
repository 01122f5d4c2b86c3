// Launch the composed config: now, or queued behind the runs already running (the server starts it when a slot
// frees); or a small sweep, one queued run per value of one field.
import { useState } from "preact/hooks";
import { api } from "../api";
import { getPath, getState, navigate, useStore } from "../store";

/** "0.01, 0.05, true, cosine" -> [0.01, 0.05, true, "cosine"]: each value as JSON when it parses, else text. */
export function parseValues(text: string): unknown[] {
  return text.split(",").map((v) => v.trim()).filter(Boolean).map((v) => {
    try {
      return JSON.parse(v);
    } catch {
      return v;
    }
  });
}

function Sweep() {
  const [field, setField] = useState("algorithm.kl_coef");
  const [values, setValues] = useState("");
  const [note, setNote] = useState<string | null>(null);
  const [error, setError] = useState<string | null>(null);
  const run = async () => {
    setError(null);
    setNote(null);
    try {
      const st = getState();
      const out = await api.sweep(st.mode, st.config, st.mode === "rl" ? st.rewards : undefined, field.trim(), parseValues(values));
      setNote(`${out.runs.length} runs queued, tagged ${out.tag}: they start one after another (--max-runs at a time).`);
    } catch (e) {
      setError((e as Error).message);
    }
  };
  return (
    <details class="sweep" data-testid="sweep">
      <summary>Sweep one field</summary>
      <div class="row">
        <input class="input mono grow" aria-label="field to sweep" placeholder="algorithm.kl_coef" value={field}
          data-testid="sweep-field" onInput={(e) => setField((e.target as HTMLInputElement).value)} />
        <input class="input mono grow" aria-label="values, comma separated" placeholder="0.01, 0.05, 0.1" value={values}
          data-testid="sweep-values" onInput={(e) => setValues((e.target as HTMLInputElement).value)} />
        <button class="btn" data-testid="sweep-run" disabled={parseValues(values).length < 2 || !field.trim()} onClick={run}>
          Queue {parseValues(values).length >= 2 ? parseValues(values).length : ""} runs
        </button>
      </div>
      <div role="status" aria-live="polite">
        {note && (
          <p class="alert ok small" data-testid="sweep-note">
            {note} <button class="btn small" onClick={() => navigate("runs")}>Runs</button>
          </p>
        )}
      </div>
      {error && <div class="alert error" data-testid="sweep-error">{error}</div>}
    </details>
  );
}

export function Launcher() {
  const s = useStore();
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const [queue, setQueue] = useState(false);
  const launch = async () => {
    setBusy(true);
    setError(null);
    try {
      const st = getState();
      const run = await api.launch(st.mode, st.config, st.mode === "rl" ? st.rewards : undefined, queue);
      navigate("watch", run.id);
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setBusy(false);
    }
  };
  const steps = getPath(s.config, s.mode === "rl" ? "controller.steps" : "steps");
  return (
    <div class="card launcher">
      <div>
        <h2>Launch</h2>
        <p class="muted">
          The composed <b>{s.mode}</b> config{typeof steps === "number" ? `, ${steps} steps` : ""}
          {s.mode === "rl" && s.rewards.length ? `, with ${s.rewards.length} code reward(s)` : ""}.
        </p>
      </div>
      <div class="row">
        <label class="inline small" title="when --max-runs runs are running, wait for one to end instead of refusing">
          <input type="checkbox" checked={queue} data-testid="launch-queue" onChange={(e) => setQueue((e.target as HTMLInputElement).checked)} />
          queue when busy
        </label>
        <button class="btn primary" data-testid="launch-run" disabled={busy} onClick={launch}>
          {busy ? "Launching…" : "Launch run"}
        </button>
      </div>
      {error && <div class="alert error" data-testid="launch-error">{error}</div>}
      <Sweep />
    </div>
  );
}
