// Try the result: one prompt answered by the model a run left and by the base model it started from, greedy,
// through tokenmill's engine; each answer's tokens coloured by their logprob (pale: the model was sure).
import { useState } from "preact/hooks";
import { api } from "../api";
import type { TrialAnswer } from "../api";

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
      <div class="muted small">{answer.tokens.length} tokens · {answer.stop} · {answer.seconds.toFixed(2)} s</div>
    </div>
  );
}

export function TryPanel({ runId }: { runId: string }) {
  const [prompt, setPrompt] = useState("");
  const [maxTokens, setMaxTokens] = useState(64);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const [out, setOut] = useState<{ result: TrialAnswer; base: TrialAnswer } | null>(null);
  const ask = async () => {
    setBusy(true);
    setError(null);
    try {
      setOut(await api.tryResult(runId, prompt, maxTokens));
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setBusy(false);
    }
  };
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
          <span class="muted small">max tokens</span>
          <input class="input narrow" type="number" min={1} max={512} value={maxTokens} data-testid="try-max-tokens"
            onChange={(e) => setMaxTokens(Number((e.target as HTMLInputElement).value))} />
        </label>
        <button class="btn primary" data-testid="try-run" disabled={busy || !prompt.trim()} onClick={ask}>
          {busy ? "Answering…" : "Ask both"}
        </button>
      </div>
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
