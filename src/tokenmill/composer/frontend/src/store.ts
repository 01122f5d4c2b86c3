// The page's one piece of shared state (what is being composed), with a tiny subscribe hook.
// Pages read it with useStore() and change it with update(); nothing else holds config.
import { useEffect, useState } from "preact/hooks";
import type { Config, Level, Mode, RewardDraft } from "./api";

export type Page = "compose" | "rewards" | "models" | "watch" | "runs";

export interface State {
  page: Page;
  mode: Mode;
  level: Level;
  config: Config;
  presetId: string | null;
  deviceMemoryGib: number;
  numDevices: number;
  rewards: RewardDraft[];
  runId: string | null;
}

export const REWARD_TEMPLATE = `def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
    """One score per completion (TRL's batched signature); None abstains."""
    return [min(len(c), 20) / 20 for c in completions]
`;

export function newReward(index: number): RewardDraft {
  const name = index === 0 ? "my_reward" : `reward_${index + 1}`;
  return { name, function: name, weight: 1, code: REWARD_TEMPLATE.replace("my_reward", name) };
}

const INITIAL: State = {
  page: "compose",
  mode: "rl",
  level: "simple",
  config: {},
  presetId: null,
  deviceMemoryGib: 16,
  numDevices: 1,
  rewards: [newReward(0)],
  runId: null,
};

// What is being composed survives a reload: kept in this browser's localStorage (never sent anywhere).
// Where the user is (page, run) lives in the URL's hash instead.
const SAVED_KEY = "tokenmill.composer.draft.v1";
const SAVED: (keyof State)[] = ["mode", "level", "config", "presetId", "deviceMemoryGib", "numDevices", "rewards"];

function restored(): State {
  try {
    const saved = JSON.parse(localStorage.getItem(SAVED_KEY) ?? "null");
    if (!saved || typeof saved !== "object") return INITIAL;
    const kept = Object.fromEntries(SAVED.filter((k) => k in saved).map((k) => [k, saved[k]]));
    return { ...INITIAL, ...kept };
  } catch {
    return INITIAL; // unreadable or blocked storage: start fresh
  }
}

function save(s: State): void {
  try {
    localStorage.setItem(SAVED_KEY, JSON.stringify(Object.fromEntries(SAVED.map((k) => [k, s[k]]))));
  } catch {
    // storage full or blocked: the draft lives until the reload, as before
  }
}

let state: State = restored();
const listeners = new Set<() => void>();

export function getState(): State {
  return state;
}

export function update(patch: Partial<State>): void {
  state = { ...state, ...patch };
  if (SAVED.some((k) => k in patch)) save(state);
  listeners.forEach((fn) => fn());
}

export function useStore(): State {
  const [, force] = useState(0);
  useEffect(() => {
    const fn = () => force((n) => n + 1);
    listeners.add(fn);
    return () => {
      listeners.delete(fn);
    };
  }, []);
  return state;
}

/** Read a dotted path ("controller.steps") from a nested config. */
export function getPath(config: Config, path: string): unknown {
  let node: unknown = config;
  for (const key of path.split(".")) {
    if (node === null || typeof node !== "object") return undefined;
    node = (node as Record<string, unknown>)[key];
  }
  return node;
}

/** A copy of `config` with `path` set to `value` (undefined removes the key, so the default applies). */
export function setPath(config: Config, path: string, value: unknown): Config {
  const keys = path.split(".");
  const root: Config = { ...config };
  let node: Record<string, unknown> = root;
  keys.slice(0, -1).forEach((key) => {
    const child = node[key];
    node[key] = child && typeof child === "object" && !Array.isArray(child) ? { ...(child as object) } : {};
    node = node[key] as Record<string, unknown>;
  });
  const last = keys[keys.length - 1];
  if (value === undefined) delete node[last];
  else node[last] = value;
  return root;
}

export function navigate(page: Page, runId?: string): void {
  const hash = runId ? `#/${page}/${encodeURIComponent(runId)}` : `#/${page}`;
  if (location.hash !== hash) location.hash = hash;
  update(runId ? { page, runId } : { page });
}

export function pageFromHash(): { page: Page; runId?: string } {
  const [, page, id] = location.hash.split("?")[0].split("/");
  const pages: Page[] = ["compose", "rewards", "models", "watch", "runs"];
  const p = (pages as string[]).includes(page) ? (page as Page) : "compose";
  return id ? { page: p, runId: decodeURIComponent(id) } : { page: p };
}

/** The page's own state in the address after `?` (`#/runs?compare=a,b&x=wall_s`): a reload or a shared link
 * opens the same view. */
export function hashParams(): URLSearchParams {
  const q = location.hash.indexOf("?");
  return new URLSearchParams(q < 0 ? "" : location.hash.slice(q + 1));
}

/** Put `params` in the address of the current page; `push` makes a new history entry (Back returns). */
export function setHashParams(params: URLSearchParams, push = false): void {
  const base = location.hash.split("?")[0] || "#/compose";
  const query = params.toString();
  const hash = query ? `${base}?${query}` : base;
  if (hash === location.hash) return;
  if (push) history.pushState(null, "", hash);
  else history.replaceState(null, "", hash);
}
