// Runs: past and live runs read from their folders; open one in Watch.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { RunInfo } from "../api";
import { formatNumber } from "../components/chart";
import { navigate } from "../store";

function when(t: number | null): string {
  return t ? new Date(t * 1000).toLocaleString() : "—";
}

export function RunsPage() {
  const [runs, setRuns] = useState<RunInfo[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const refresh = () => api.runs().then((r) => { setRuns(r.runs); setError(null); }, (e) => setError(e.message));
  useEffect(() => {
    refresh();
    const timer = setInterval(refresh, 5000);
    return () => clearInterval(timer);
  }, []);
  return (
    <div class="page" data-testid="page-runs">
      <header class="page-head">
        <div>
          <h1>Runs</h1>
          <p class="muted">Every run folder the Composer knows, newest first; reopen any of them from its files.</p>
        </div>
        <button class="btn" onClick={refresh} data-testid="runs-refresh">Refresh</button>
      </header>
      {error && <div class="alert error">{error}</div>}
      <div class="card">
        <div class="table-wrap">
          <table class="table" data-testid="runs-table">
            <thead>
              <tr><th>run</th><th>mode</th><th>status</th><th class="num">step</th><th class="num">reward</th><th>started</th><th>folder</th><th /></tr>
            </thead>
            <tbody>
              {(runs ?? []).map((r) => {
                const reward = r.last_metrics?.["reward/mean"];
                return (
                  <tr data-testid={`run-row-${r.id}`}>
                    <td class="mono">{r.id}</td>
                    <td>{r.mode}</td>
                    <td><span class={`badge status-${r.status}`}>{r.status}</span></td>
                    <td class="num mono">{r.step ?? "—"}{r.total_steps ? `/${r.total_steps}` : ""}</td>
                    <td class="num mono">{typeof reward === "number" ? formatNumber(reward) : "—"}</td>
                    <td>{when(r.started)}</td>
                    <td class="mono small path">{r.output_dir}</td>
                    <td><button class="btn small" data-testid={`run-open-${r.id}`} onClick={() => navigate("watch", r.id)}>Open</button></td>
                  </tr>
                );
              })}
            </tbody>
          </table>
        </div>
        {runs && runs.length === 0 && <p class="muted">No runs yet: launch one from Watch.</p>}
        {!runs && !error && <p class="muted">Loading…</p>}
      </div>
    </div>
  );
}
