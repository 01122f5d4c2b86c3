// Rewards: reward functions written in the page (TRL's batched signature), weights, and a preview
// that samples a few completions from the chosen model and scores each with every reward.
import { useRef, useState } from "preact/hooks";
import { api } from "../api";
import type { Preview, RewardDraft } from "../api";
import { formatNumber } from "../components/chart";
import { CodeEditor } from "../components/editor";
import { getState, newReward, update, useStore } from "../store";

function setReward(index: number, patch: Partial<RewardDraft>): void {
  const rewards = getState().rewards.map((r, i) => (i === index ? { ...r, ...patch } : r));
  update({ rewards });
}

function RewardCard({ reward, index, total }: { reward: RewardDraft; index: number; total: number }) {
  const share = total > 0 ? (100 * Math.abs(reward.weight)) / total : 0;
  return (
    <div class="card reward" data-testid={`reward-${index}`}>
      <div class="reward-head">
        <label class="inline">
          <span class="muted small">name</span>
          <input
            class="input"
            data-testid={`reward-name-${index}`}
            value={reward.name}
            onInput={(e) => setReward(index, { name: (e.target as HTMLInputElement).value })}
          />
        </label>
        <label class="inline" title="The function in the code below that returns one score per completion.">
          <span class="muted small">function</span>
          <input
            class="input mono"
            data-testid={`reward-function-${index}`}
            value={reward.function}
            onInput={(e) => setReward(index, { function: (e.target as HTMLInputElement).value })}
          />
        </label>
        <label class="inline grow" title="Weight of this reward in the total (the weighted sum).">
          <span class="muted small">weight</span>
          <input
            type="range"
            min={0}
            max={2}
            step={0.05}
            data-testid={`reward-weight-${index}`}
            value={reward.weight}
            onInput={(e) => setReward(index, { weight: Number((e.target as HTMLInputElement).value) })}
          />
          <span class="mono weight">{reward.weight.toFixed(2)}</span>
          <span class="muted small">{share.toFixed(0)}%</span>
        </label>
        <label class="inline" title="Seconds one call may take; past it the worker is killed and the samples get an error.">
          <span class="muted small">timeout s</span>
          <input
            class="input narrow"
            type="number"
            min={0.1}
            max={300}
            step={1}
            aria-label={`timeout in seconds of reward ${reward.name}`}
            data-testid={`reward-timeout-${index}`}
            value={reward.timeout_s ?? 10}
            onChange={(e) => {
              // out of range is sent as typed: the server's answer names the field and its limits
              const seconds = Number((e.target as HTMLInputElement).value);
              if (Number.isFinite(seconds)) setReward(index, { timeout_s: seconds });
            }}
          />
        </label>
        <button
          class="btn ghost"
          data-testid={`reward-remove-${index}`}
          onClick={() => update({ rewards: getState().rewards.filter((_, i) => i !== index) })}
        >
          Remove
        </button>
      </div>
      <CodeEditor testId={`reward-editor-${index}`} label={`code of reward ${reward.name}`} value={reward.code}
        onChange={(code) => setReward(index, { code })} />
    </div>
  );
}

function ScoreCell({ value, error, testId }: { value: number | null | undefined; error?: string; testId: string }) {
  if (error) {
    return (
      <td class="score error" data-testid={testId} data-error={error} title={error}>
        <span class="err-text">{error}</span>
      </td>
    );
  }
  return (
    <td class="score num mono" data-testid={testId} data-value={value === null || value === undefined ? "null" : String(value)}>
      {value === null || value === undefined ? "—" : formatNumber(value)}
    </td>
  );
}

function PreviewTable({ preview, names }: { preview: Preview; names: string[] }) {
  // every reward the server scored (a built-in task adds its own), in the order the page lists them
  const seen = preview.samples.flatMap((s) => [...Object.keys(s.scores ?? {}), ...Object.keys(s.errors ?? {})]);
  const cols = [...new Set([...names.filter((n) => seen.includes(n)), ...seen])];
  return (
    <div>
      <p class="muted small" data-testid="zero-variance">
        Groups with identical rewards (no learning signal):{" "}
        {preview.zero_variance_fraction === null || preview.zero_variance_fraction === undefined
          ? "—"
          : `${(100 * preview.zero_variance_fraction).toFixed(0)}%`}
      </p>
      <div class="table-wrap">
        <table class="table" data-testid="preview-table">
          <thead>
            <tr>
              <th>group</th>
              <th>prompt</th>
              <th>completion</th>
              {cols.map((n) => (
                <th class="num">{n}</th>
              ))}
              <th class="num">total</th>
            </tr>
          </thead>
          <tbody>
            {preview.samples.map((s, i) => (
              <tr data-testid={`preview-row-${i}`}>
                <td class="mono">{s.group}</td>
                <td class="text">{s.prompt}</td>
                <td class="text mono">{s.completion}</td>
                {cols.map((n) => (
                  <ScoreCell value={s.scores?.[n]} error={s.errors?.[n]} testId={`score-${i}-${n}`} />
                ))}
                <ScoreCell value={s.total} testId={`total-${i}`} />
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </div>
  );
}

export function RewardsPage() {
  const s = useStore();
  const [prompts, setPrompts] = useState(2);
  const [samples, setSamples] = useState(4);
  const [preview, setPreview] = useState<Preview | null>(null);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const [cancelled, setCancelled] = useState(false);
  // a cancelled preview still runs on the server, which scores one preview at a time: the next one waits
  const [queued, setQueued] = useState(false);
  const draining = useRef(false);
  const pending = useRef<AbortController | null>(null);
  const total = s.rewards.reduce((a, r) => a + Math.abs(r.weight), 0);
  const run = async () => {
    setBusy(true);
    setError(null);
    setCancelled(false);
    setQueued(draining.current);
    const abort = new AbortController();
    pending.current = abort;
    try {
      setPreview(await api.preview(s.mode, s.config, s.rewards, prompts, samples, abort.signal));
      draining.current = false; // answered: the server is done with the cancelled one too
    } catch (e) {
      if (abort.signal.aborted) {
        setCancelled(true);
        draining.current = true;
      } else setError((e as Error).message);
    } finally {
      if (pending.current === abort) pending.current = null;
      setBusy(false);
      setQueued(false);
    }
  };
  const topErrors = (preview?.errors ?? []).map((e) => (typeof e === "string" ? e : JSON.stringify(e)));
  return (
    <div class="page" data-testid="page-rewards">
      <header class="page-head">
        <div>
          <h1>Rewards</h1>
          <p class="muted">
            Each reward is <span class="mono">fn(prompts, completions, **columns) -&gt; list[float | None]</span>; the total is
            the weighted sum. A built-in task adds its own verifier.
          </p>
        </div>
        <button class="btn" data-testid="reward-add" onClick={() => update({ rewards: [...s.rewards, newReward(s.rewards.length)] })}>
          Add reward
        </button>
      </header>
      {s.rewards.map((r, i) => (
        <RewardCard reward={r} index={i} total={total} />
      ))}
      {s.rewards.length === 0 && <p class="muted">No custom rewards: the task's own verifier scores the samples.</p>}
      <div class="card">
        <div class="card-head">
          <h2>Preview</h2>
          <div class="row">
            <label class="inline">
              <span class="muted small">prompts</span>
              <input class="input narrow" type="number" min={1} max={16} value={prompts} data-testid="preview-prompts"
                onChange={(e) => setPrompts(Number((e.target as HTMLInputElement).value))} />
            </label>
            <label class="inline">
              <span class="muted small">samples each</span>
              <input class="input narrow" type="number" min={1} max={16} value={samples} data-testid="preview-samples"
                onChange={(e) => setSamples(Number((e.target as HTMLInputElement).value))} />
            </label>
            <button class="btn primary" data-testid="preview-run" disabled={busy} onClick={run}>
              {busy ? "Sampling…" : "Sample and score"}
            </button>
            {busy && (
              <button class="btn" data-testid="preview-cancel" onClick={() => pending.current?.abort()}>
                Cancel
              </button>
            )}
          </div>
        </div>
        <p class="help">Samples a few completions from the chosen model and runs every reward on them in the sandbox, with a timeout.</p>
        {error && <div class="alert error" data-testid="preview-error">{error}</div>}
        {busy && queued && (
          <p class="alert warn small" role="status" data-testid="preview-waiting">
            Waiting for the server to finish the cancelled preview (each reward within its timeout); this one starts
            right after it.
          </p>
        )}
        {cancelled && (
          <p class="muted small" data-testid="preview-cancelled">
            Cancelled. The server still finishes the samples it started (each reward within its timeout) and
            drops them.
          </p>
        )}
        {topErrors.length > 0 && (
          <div class="alert error" data-testid="preview-errors">
            {topErrors.map((e) => (
              <div>{e}</div>
            ))}
          </div>
        )}
        {preview && <PreviewTable preview={preview} names={s.rewards.map((r) => r.name)} />}
      </div>
    </div>
  );
}
