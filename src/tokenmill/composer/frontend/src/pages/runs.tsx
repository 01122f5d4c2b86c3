// Runs: past and live runs read from their folders (nested folders too), with a name, tags and duration;
// sorted, searched, filtered by status and tag, archived; open one in Watch, or tick 2-4 and compare them
// (components/compare.tsx). On a phone each run is a card.
import { useEffect, useRef, useState } from "preact/hooks";
import { api } from "../api";
import type { RunInfo } from "../api";
import { formatDuration, formatNumber } from "../components/chart";
import { CompareView, X_AXES } from "../components/compare";
import type { CompareState, XAxis } from "../components/compare";
import { hashParams, navigate, setHashParams, update } from "../store";

const MAX_COMPARED = 4;

function when(t: number | null): string {
  return t ? new Date(t * 1000).toLocaleString(undefined, { dateStyle: "short", timeStyle: "short" }) : "—";
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

type SortKey = "started" | "id" | "status" | "step" | "last" | "duration" | `col:${string}`;
const SORTS: { key: SortKey; title: string; num?: boolean }[] = [
  { key: "id", title: "run" }, { key: "status", title: "status" }, { key: "step", title: "step", num: true },
  { key: "last", title: "last", num: true }, { key: "started", title: "started" }, { key: "duration", title: "duration", num: true },
];

function lastValue(r: RunInfo): number | null {
  const m = r.last_metrics ?? {};
  const v = m["reward/mean"] ?? m["loss"];
  return typeof v === "number" ? v : null;
}

function sortValue(r: RunInfo, key: SortKey): number | string {
  if (key.startsWith("col:")) {
    const v = r.columns?.[key.slice(4)];
    return typeof v === "number" ? v : v === null || v === undefined ? -Infinity : JSON.stringify(v);
  }
  switch (key) {
    case "id": return (r.name || r.id).toLowerCase();
    case "status": return r.status;
    case "step": return r.step ?? -Infinity;
    case "last": return lastValue(r) ?? -Infinity;
    case "duration": return r.duration_s ?? -Infinity;
    default: return r.started ?? 0;
  }
}

/** The compared runs and how, from the address (`#/runs?compare=a,b&x=wall_s&m=lr`). */
function compareFromHash(): CompareState {
  const p = hashParams();
  const ids = (p.get("compare") ?? "").split(",").filter(Boolean).slice(0, MAX_COMPARED);
  const x = X_AXES.some((a) => a.id === p.get("x")) ? (p.get("x") as XAxis) : "step";
  return { ids, x, extra: (p.get("m") ?? "").split(",").filter(Boolean) };
}

function compareToHash(c: CompareState, push: boolean): void {
  const p = hashParams();
  ["compare", "x", "m"].forEach((k) => p.delete(k));
  if (c.ids.length >= 2) {
    p.set("compare", c.ids.join(","));
    if (c.x !== "step") p.set("x", c.x);
    if (c.extra.length) p.set("m", c.extra.join(","));
  }
  setHashParams(p, push);
}

function Filters(props: { runs: RunInfo[]; query: string; setQuery: (q: string) => void; status: string; setStatus: (s: string) => void;
  tag: string; setTag: (t: string) => void; archived: boolean; setArchived: (a: boolean) => void;
  columns: string[]; setColumns: (c: string[]) => void }) {
  const [cols, setCols] = useState(props.columns.join(", "));
  const tags = [...new Set(props.runs.flatMap((r) => r.tags ?? []))].sort();
  const hidden = props.runs.filter((r) => r.archived).length;
  return (
    <div class="row filters">
      <input class="input search" type="search" placeholder="search runs, names, tags" aria-label="search runs" value={props.query}
        data-testid="runs-search" onInput={(e) => props.setQuery((e.target as HTMLInputElement).value)} />
      <select class="input auto" aria-label="status filter" data-testid="runs-status" value={props.status}
        onChange={(e) => props.setStatus((e.target as HTMLSelectElement).value)}>
        <option value="">any status</option>
        {["running", "finished", "failed", "stopped", "unknown"].map((st) => <option value={st}>{st}</option>)}
      </select>
      <select class="input auto" aria-label="tag filter" data-testid="runs-tag" value={props.tag}
        onChange={(e) => props.setTag((e.target as HTMLSelectElement).value)}>
        <option value="">any tag</option>
        {tags.map((t) => <option value={t}>{t}</option>)}
      </select>
      <label class="inline small">
        <input type="checkbox" checked={props.archived} data-testid="runs-show-archived"
          onChange={(e) => props.setArchived((e.target as HTMLInputElement).checked)} />
        archived ({hidden})
      </label>
      <input class="input mono cols" placeholder="config columns: algorithm.kl_coef, generation.group_size" aria-label="config columns"
        value={cols} data-testid="runs-columns" onInput={(e) => setCols((e.target as HTMLInputElement).value)}
        onChange={() => props.setColumns(cols.split(/[\s,]+/).filter(Boolean))} />
    </div>
  );
}

function show(v: unknown): string {
  return v === null || v === undefined ? "—" : typeof v === "string" ? v : JSON.stringify(v);
}

function RunRow({ r, picked, toggle, refresh, columns }: { r: RunInfo; picked: boolean; toggle: (id: string, on: boolean) => void;
  refresh: () => void; columns: string[] }) {
  const archive = () => api.labels(r.id, r.name ?? null, r.tags ?? [], !r.archived).then(refresh);
  const [error, setError] = useState<string | null>(null);
  const resume = () => api.resume(r.id).then(() => navigate("watch", r.id), (e) => setError(e.message));
  // start a new run from this one: its config (and the rewards written in the page, as code) into Compose
  const clone = () => api.clone(r.id).then((c) => {
    update({ mode: c.mode, config: c.config, rewards: c.rewards, presetId: null });
    navigate("compose");
  });
  return (
    <tr key={r.id} data-testid={`run-row-${r.id}`} class={r.archived ? "archived" : ""}>
      <td class="pick">
        <input type="checkbox" checked={picked} aria-label={`compare run ${r.id}`} data-testid={`run-pick-${r.id}`}
          onChange={(e) => toggle(r.id, (e.target as HTMLInputElement).checked)} />
      </td>
      <td class="path" data-label="run">
        <div class="mono small run-id">{r.id}</div>
        <div class="actions">
          <button class="btn small" data-testid={`run-open-${r.id}`} onClick={() => navigate("watch", r.id)}>Open</button>
          <button class="btn small" data-testid={`run-clone-${r.id}`} title="a new run from this one's config and rewards" onClick={clone}>Clone</button>
          {(r.status === "stopped" || r.status === "failed") && (
            <button class="btn small" data-testid={`run-resume-${r.id}`} title="continue from its newest checkpoint, in its folder" onClick={resume}>Resume</button>
          )}
          <button class="btn small ghost" data-testid={`run-archive-${r.id}`} onClick={archive}>{r.archived ? "Unarchive" : "Archive"}</button>
        </div>
        {error && <div class="field-error" data-testid={`run-resume-error-${r.id}`}>{error}</div>}
      </td>
      <td data-label="name, tags"><Labels run={r} onSaved={refresh} /></td>
      <td data-label="mode">{r.mode}</td>
      <td data-label="status"><span class={`badge status-${r.status}`} data-testid={`run-status-${r.id}`}>{r.status}</span></td>
      <td class="num mono" data-label="step" data-testid={`run-step-${r.id}`}>{r.step ?? "—"}{r.total_steps ? `/${r.total_steps}` : ""}</td>
      <td class="num mono" data-label="last" data-testid={`run-last-${r.id}`}>{headline(r)}</td>
      <td data-label="started">{when(r.started)}</td>
      <td class="num mono" data-label="duration" data-testid={`run-duration-${r.id}`}>{typeof r.duration_s === "number" ? formatDuration(r.duration_s) : "—"}</td>
      {columns.map((c) => <td class="mono small" data-label={c} data-testid={`run-col-${r.id}-${c}`}>{show(r.columns?.[c])}</td>)}
    </tr>
  );
}

export function RunsPage() {
  const [runs, setRuns] = useState<RunInfo[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [compare, setCompare] = useState<CompareState>(compareFromHash);
  const [picked, setPicked] = useState<string[]>(() => compareFromHash().ids);
  const [refused, setRefused] = useState<string | null>(null);
  const [sort, setSort] = useState<{ key: SortKey; desc: boolean }>({ key: "started", desc: true });
  const [query, setQuery] = useState("");
  const [status, setStatus] = useState("");
  const [tag, setTag] = useState("");
  const [archived, setArchived] = useState(false);
  const [columns, setColumnsState] = useState<string[]>(() => (hashParams().get("cols") ?? "").split(",").filter(Boolean));
  const wanted = useRef(columns);
  wanted.current = columns;
  const refresh = () => api.runs(wanted.current).then((r) => { setRuns(r.runs); setError(null); }, (e) => setError(e.message));
  const setColumns = (c: string[]) => {
    setColumnsState(c);
    wanted.current = c;
    const p = hashParams();
    if (c.length) p.set("cols", c.join(","));
    else p.delete("cols");
    setHashParams(p);
    refresh();
  };
  useEffect(() => {
    refresh();
    const timer = setInterval(refresh, 5000);
    const sync = () => setCompare(compareFromHash());
    window.addEventListener("popstate", sync);
    return () => {
      clearInterval(timer);
      window.removeEventListener("popstate", sync);
    };
  }, []);
  const changeCompare = (c: CompareState, push = false) => {
    setCompare(c);
    compareToHash(c, push);
  };
  const toggle = (id: string, on: boolean) => {
    if (on && picked.length >= MAX_COMPARED) {
      setRefused(`Compare takes at most ${MAX_COMPARED} runs: untick one of ${picked.join(", ")} first.`);
      return;
    }
    setRefused(null);
    setPicked((p) => (on ? [...p, id] : p.filter((x) => x !== id)));
  };
  const q = query.trim().toLowerCase();
  const shown = (runs ?? [])
    .filter((r) => archived || !r.archived || picked.includes(r.id))
    .filter((r) => !status || r.status === status)
    .filter((r) => !tag || (r.tags ?? []).includes(tag))
    .filter((r) => !q || [r.id, r.name ?? "", r.mode, ...(r.tags ?? [])].some((t) => t.toLowerCase().includes(q)))
    .sort((a, b) => {
      const x = sortValue(a, sort.key);
      const y = sortValue(b, sort.key);
      return (x < y ? -1 : x > y ? 1 : 0) * (sort.desc ? -1 : 1);
    });
  const sortBy = (key: SortKey) => setSort((s) => ({ key, desc: s.key === key ? !s.desc : key !== "id" && key !== "status" }));
  return (
    <div class="page" data-testid="page-runs">
      <header class="page-head">
        <div>
          <h1>Runs</h1>
          <p class="muted">Every run folder the Composer knows (nested folders too); reopen one from its files, or tick 2-4 and compare them.</p>
        </div>
        <div class="row">
          <button class="btn primary" data-testid="compare-runs" disabled={picked.length < 2}
            onClick={() => changeCompare({ ids: picked, x: compare.x, extra: compare.extra }, true)}>
            Compare {picked.length >= 2 ? picked.length : ""} runs
          </button>
          <button class="btn" onClick={refresh} data-testid="runs-refresh">Refresh</button>
        </div>
      </header>
      {error && <div class="alert error">{error}</div>}
      <div role="status" aria-live="polite">
        {refused && <div class="alert warn" data-testid="compare-limit">{refused}</div>}
      </div>
      {compare.ids.length >= 2 && <CompareView state={compare} onState={(c) => changeCompare(c)} />}
      <div class="card">
        <Filters runs={runs ?? []} query={query} setQuery={setQuery} status={status} setStatus={setStatus} tag={tag} setTag={setTag}
          archived={archived} setArchived={setArchived} columns={columns} setColumns={setColumns} />
        <div class="table-wrap runs-wrap">
          <table class="table runs-table" data-testid="runs-table" data-shown={shown.length}>
            <thead>
              <tr>
                <th />
                {SORTS.slice(0, 1).map((c) => <SortHead c={c} sort={sort} sortBy={sortBy} />)}
                <th>name, tags</th><th>mode</th>
                {SORTS.slice(1).map((c) => <SortHead c={c} sort={sort} sortBy={sortBy} />)}
                {columns.map((k) => <SortHead c={{ key: `col:${k}`, title: k }} sort={sort} sortBy={sortBy} />)}
              </tr>
            </thead>
            <tbody>
              {shown.map((r) => <RunRow r={r} picked={picked.includes(r.id)} toggle={toggle} refresh={refresh} columns={columns} />)}
            </tbody>
          </table>
        </div>
        {runs && runs.length === 0 && <p class="muted">No runs yet: launch one from Watch.</p>}
        {runs && runs.length > 0 && shown.length === 0 && <p class="muted" data-testid="runs-none-match">No run matches the filters.</p>}
        {!runs && !error && <p class="muted">Loading…</p>}
      </div>
    </div>
  );
}

function SortHead({ c, sort, sortBy }: { c: { key: SortKey; title: string; num?: boolean }; sort: { key: SortKey; desc: boolean }; sortBy: (k: SortKey) => void }) {
  const active = sort.key === c.key;
  return (
    <th class={c.num ? "num" : ""} aria-sort={active ? (sort.desc ? "descending" : "ascending") : "none"}>
      <button class="sort" data-testid={`sort-${c.key}`} onClick={() => sortBy(c.key)}>
        {c.title}{active ? (sort.desc ? " ▾" : " ▴") : ""}
      </button>
    </th>
  );
}
