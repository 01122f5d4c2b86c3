// Runs: past and live runs read from their folders (nested folders too), with a name, tags and duration;
// open one in Watch, or select 2-4 and compare them: overlaid curves per metric and the config keys that differ.
import { useEffect, useState } from "preact/hooks";
import { api } from "../api";
import type { Comparison, RunInfo } from "../api";
import { align, formatDuration, formatNumber, LineChart, SmoothingControl } from "../components/chart";
import { navigate } from "../store";

const COLORS = ["#2563eb", "#db2777", "#16a34a", "#ea580c"];
const MAX_COMPARED = 4;

function when(t: number | null): string {
  return t ? new Date(t * 1000).toLocaleString() : "—";
}

/** The run's headline number: RL's mean reward, else the loss of SFT / preference / reward-model runs. */
function headline(r: RunInfo): string {
  const m = r.last_metrics ?? {};
  for (const key of ["reward/mean", "loss"]) {
    const v = m[key];
    if (typeof v === "number") return `${key === "loss" ? "loss " : ""}${formatNumber(v)}`;
  }
  return "—";
}

function Labels({ run, onSaved }: { run: RunInfo; onSaved: () => void }) {
  const [name, setName] = useState(run.name ?? "");
  const [tags, setTags] = useState((run.tags ?? []).join(" "));
  const [error, setError] = useState<string | null>(null);
  // each box follows its own saved value only: a refresh after saving the name must not wipe tags being typed
  useEffect(() => setName(run.name ?? ""), [run.name]);
  useEffect(() => setTags((run.tags ?? []).join(" ")), [(run.tags ?? []).join(" ")]);
  const save = () => {
    const list = tags.split(/[\s,]+/).filter(Boolean);
    if (name === (run.name ?? "") && list.join(" ") === (run.tags ?? []).join(" ")) return;
    api.labels(run.id, name || null, list).then(() => (setError(null), onSaved()), (e) => setError(e.message));
  };
  return (
    <div class="labels">
      <input class="input" value={name} placeholder="name" aria-label={`name of run ${run.id}`} data-testid={`run-name-${run.id}`}
        onInput={(e) => setName((e.target as HTMLInputElement).value)} onChange={save} />
      <input class="input mono small" value={tags} placeholder="tags" aria-label={`tags of run ${run.id}`} data-testid={`run-tags-${run.id}`}
        onInput={(e) => setTags((e.target as HTMLInputElement).value)} onChange={save} />
      {error && <div class="field-error">{error}</div>}
    </div>
  );
}

function show(v: unknown): string {
  return v === null || v === undefined ? "—" : typeof v === "string" ? v : JSON.stringify(v);
}

function CompareView({ ids }: { ids: string[] }) {
  const [data, setData] = useState<Comparison | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [smoothing, setSmoothing] = useState(0);
  useEffect(() => {
    let live = true;
    setData(null);
    api.compare(ids).then((d) => live && (setData(d), setError(null)), (e) => live && setError(e.message));
    return () => {
      live = false;
    };
  }, [ids.join(",")]);
  if (error) return <div class="alert error" data-testid="compare-error">{error}</div>;
  if (!data) return <p class="muted">Loading…</p>;
  const label = (r: RunInfo) => r.name || r.id;
  return (
    <div class="card" data-testid="compare">
      <div class="card-head">
        <h2>Compare {data.runs.length} runs</h2>
        <SmoothingControl value={smoothing} onChange={setSmoothing} />
      </div>
      {data.metrics.length === 0 && <p class="muted">These runs share no metric.</p>}
      <div class="chart-grid">
        {data.metrics.map((m) => {
          const { steps, values } = align(data.runs.map((r) => r.curves[m] ?? []));
          return (
            <LineChart title={m} testId={`compare-chart-${m.replace(/[^A-Za-z0-9_-]/g, "_")}`} steps={steps} smoothing={smoothing}
              series={data.runs.map((r, i) => ({ label: label(r), values: values[i], color: COLORS[i % COLORS.length] }))} />
          );
        })}
      </div>
      <h3>Config differences</h3>
      {data.config_diff.length === 0 ? (
        <p class="muted" data-testid="compare-same-config">The configs are the same.</p>
      ) : (
        <div class="table-wrap">
          <table class="table diff" data-testid="compare-diff">
            <thead>
              <tr>
                <th>key</th>
                {data.runs.map((r) => (
                  <th>{label(r)}</th>
                ))}
              </tr>
            </thead>
            <tbody>
              {data.config_diff.map((d) => (
                <tr data-testid={`diff-${d.path}`}>
                  <td class="mono">{d.path}</td>
                  {data.runs.map((r) => (
                    <td class="mono" data-run={r.id}>{show(d.values[r.id])}</td>
                  ))}
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
    </div>
  );
}

export function RunsPage() {
  const [runs, setRuns] = useState<RunInfo[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [picked, setPicked] = useState<string[]>([]);
  const [compared, setCompared] = useState<string[]>([]);
  const refresh = () => api.runs().then((r) => { setRuns(r.runs); setError(null); }, (e) => setError(e.message));
  useEffect(() => {
    refresh();
    const timer = setInterval(refresh, 5000);
    return () => clearInterval(timer);
  }, []);
  const toggle = (id: string, on: boolean) => setPicked((p) => (on ? [...p, id].slice(-MAX_COMPARED) : p.filter((x) => x !== id)));
  return (
    <div class="page" data-testid="page-runs">
      <header class="page-head">
        <div>
          <h1>Runs</h1>
          <p class="muted">Every run folder the Composer knows (nested folders too), newest first; reopen one from its files, or tick 2-4 and compare them.</p>
        </div>
        <div class="row">
          <button class="btn primary" data-testid="compare-runs" disabled={picked.length < 2} onClick={() => setCompared(picked)}>
            Compare {picked.length >= 2 ? picked.length : ""} runs
          </button>
          <button class="btn" onClick={refresh} data-testid="runs-refresh">Refresh</button>
        </div>
      </header>
      {error && <div class="alert error">{error}</div>}
      {compared.length >= 2 && <CompareView ids={compared} />}
      <div class="card">
        <div class="table-wrap">
          <table class="table" data-testid="runs-table">
            <thead>
              <tr><th /><th>run</th><th>name, tags</th><th>mode</th><th>status</th><th class="num">step</th><th class="num">last</th><th>started</th><th class="num">duration</th><th /></tr>
            </thead>
            <tbody>
              {(runs ?? []).map((r) => (
                <tr key={r.id} data-testid={`run-row-${r.id}`}>
                  <td>
                    <input type="checkbox" checked={picked.includes(r.id)} aria-label={`compare run ${r.id}`} data-testid={`run-pick-${r.id}`}
                      onChange={(e) => toggle(r.id, (e.target as HTMLInputElement).checked)} />
                  </td>
                  <td class="mono small path">{r.id}</td>
                  <td><Labels run={r} onSaved={refresh} /></td>
                  <td>{r.mode}</td>
                  <td><span class={`badge status-${r.status}`}>{r.status}</span></td>
                  <td class="num mono">{r.step ?? "—"}{r.total_steps ? `/${r.total_steps}` : ""}</td>
                  <td class="num mono" data-testid={`run-last-${r.id}`}>{headline(r)}</td>
                  <td>{when(r.started)}</td>
                  <td class="num mono" data-testid={`run-duration-${r.id}`}>{typeof r.duration_s === "number" ? formatDuration(r.duration_s) : "—"}</td>
                  <td><button class="btn small" data-testid={`run-open-${r.id}`} onClick={() => navigate("watch", r.id)}>Open</button></td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
        {runs && runs.length === 0 && <p class="muted">No runs yet: launch one from Watch.</p>}
        {!runs && !error && <p class="muted">Loading…</p>}
      </div>
    </div>
  );
}
