// Try the result: one prompt answered by the model a run left (or one of its checkpoints) and by the base model
// it started from, greedy, each by its own `tokenmill serve`; each answer's tokens coloured by their logprob
// (pale: the model was sure). Export writes the chosen model as a plain HF folder (LoRA adapters merged).
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { ModelSource, TrialAnswer } from "../api";

/** A token's background: white at logprob 0 (certain), deeper amber as the probability falls. */
export function tokenShade(logprob: number): string {
  const p = Math.exp(Math.max(logprob, -20));
  return `rgba(245, 158, 11, ${(0.7 * (1 - p)).toFixed(3)})`;
}

function Answer({ title, answer, testId }: { title: string; answer: TrialAnswer; testId: string }) {
  return (
    <div class="side" data-testid={testId}>
      <b>{title}</b> <span class="muted small mono">{answer.path}</span>
      <div class="tokens mono" aria-label={`${title}: ${answer.text}`}>
        {answer.tokens.map((t) => (
          <span class="tok" data-logprob={t.logprob} title={`logprob ${t.logprob.toFixed(3)} (p ${Math.exp(t.logprob).toFixed(3)})`}
            style={{ background: tokenShade(t.logprob) }}>{t.text}</span>
        ))}
      </div>
      <div class="muted small">{answer.tokens.length} tokens · {answer.stop} · {answer.seconds.toFixed(2)} s
        {answer.server ? ` · ${answer.server}` : ""}</div>
    </div>
  );
}

export function TryPanel({ runId }: { runId: string }) {
  const [prompt, setPrompt] = useState("");
  const [maxTokens, setMaxTokens] = useState(64);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const [out, setOut] = useState<{ result: TrialAnswer; base: TrialAnswer } | null>(null);
  const [sources, setSources] = useState<ModelSource[]>([]);
  const [source, setSource] = useState("final");
  const [exported, setExported] = useState<{ path: string; adapter: string | null } | null>(null);
  useEffect(() => {
    api.models(runId).then((m) => {
      const ready = m.sources.filter((x) => x.ready);
      setSources(ready);
      if (ready.length && !ready.some((x) => x.name === "final")) setSource(ready[ready.length - 1].name);
    }).catch(() => setSources([]));
  }, [runId]);
  const act = async (work: () => Promise<void>) => {
    setBusy(true);
    setError(null);
    try {
      await work();
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setBusy(false);
    }
  };
  const ask = () => act(async () => setOut(await api.tryResult(runId, prompt, maxTokens, source)));
  const exportIt = () => act(async () => setExported(await api.exportModel(runId, source)));
  return (
    <div class="card" data-testid="try-panel">
      <div class="card-head">
        <h2>Try the result</h2>
        <span class="muted small">the trained model beside its base model, greedy; tokens shaded by logprob</span>
      </div>
      <textarea class="input mono" rows={3} aria-label="prompt to try" placeholder="a prompt for both models" value={prompt}
        data-testid="try-prompt" onInput={(e) => setPrompt((e.target as HTMLTextAreaElement).value)} />
      <div class="row" style={{ marginTop: "8px" }}>
        <label class="inline">
          <span class="muted small">model</span>
          <select class="input" data-testid="try-source" value={source} aria-label="the run's model to try"
            onChange={(e) => { setSource((e.target as HTMLSelectElement).value); setExported(null); }}>
            {(sources.length ? sources : [{ name: "final", ready: true }]).map((x) => (
              <option value={x.name}>{x.name === "final" ? "final" : `checkpoint ${Number(x.name.slice(5))}`}</option>
            ))}
          </select>
        </label>
        <label class="inline">
          <span class="muted small">max tokens</span>
          <input class="input narrow" type="number" min={1} max={512} value={maxTokens} data-testid="try-max-tokens"
            onChange={(e) => setMaxTokens(Number((e.target as HTMLInputElement).value))} />
        </label>
        <button class="btn primary" data-testid="try-run" disabled={busy || !prompt.trim()} onClick={ask}>
          {busy ? "Working…" : "Ask both"}
        </button>
        <button class="btn" data-testid="try-export" disabled={busy} onClick={exportIt}
          title="write this model as a plain Hugging Face folder (LoRA adapters merged)">Export</button>
      </div>
      {exported && (
        <div class="muted small" data-testid="try-exported" aria-live="polite">
          HF folder: <span class="mono">{exported.path}</span>
          {exported.adapter && <> · adapter: <span class="mono">{exported.adapter}</span></>}
        </div>
      )}
      {error && <div class="alert error" data-testid="try-error">{error}</div>}
      {out && (
        <div class="side-by-side">
          <Answer title="base" answer={out.base} testId="try-answer-base" />
          <Answer title="trained" answer={out.result} testId="try-answer-result" />
        </div>
      )}
    </div>
  );
}
