// Typed calls to the Composer's HTTP API (see ../../API.md). The page only renders: every rule
// (schema, validation, YAML, memory, rewards, runs) lives in Python behind these routes.

export type Mode = "rl" | "preference" | "reward_model" | "sft";
export type Level = "simple" | "advanced" | "expert";
export type Config = Record<string, unknown>;

export interface SchemaField {
  path: string;
  type: "integer" | "number" | "string" | "boolean" | "enum" | "list" | "object" | "json";
  enum?: unknown[] | null;
  items?: string | null;
  optional_section?: string | null;
  default?: unknown;
  description?: string;
  level: Level;
  group: string;
  minimum?: number | null;
  maximum?: number | null;
  required?: boolean;
  nullable?: boolean;
}

export interface Schema {
  mode: Mode;
  modes: { id: Mode; title: string; command: string }[];
  levels?: Level[];
  groups?: { id: string; title: string; description?: string }[];
  fields: SchemaField[];
}

export interface Preset {
  id: string;
  title: string;
  mode: Mode;
  config: Config;
  device_memory_gib: number;
  num_devices: number;
  description?: string;
  /** Where the model comes from: a local folder, or the Hub id (downloaded on first use). */
  model_source?: string;
  local?: boolean;
}

export interface FieldError {
  path: string;
  message: string;
}

export interface Validation {
  ok: boolean;
  errors: FieldError[];
  config?: Config;
}

export interface ExportedFile {
  path: string;
  content: string;
}

export interface RewardDraft {
  name: string;
  code: string;
  function: string;
  weight: number;
  timeout_s?: number; // seconds one call may take (the server's default, 10, when unset)
}

export interface PreviewSample {
  group: number;
  prompt: string;
  completion: string;
  scores: Record<string, number | null>;
  errors: Record<string, string>;
  total: number | null;
}

export interface Preview {
  samples: PreviewSample[];
  rewards?: { name: string; weight: number; source: string; seconds: number | null; error: string | null }[];
  groups?: { group: number; prompt: string; mean: number | null; std: number | null; zero_variance: boolean }[];
  zero_variance_fraction: number | null;
  errors: unknown[];
  seconds?: Record<string, number>;
}

export interface DiagramModel {
  role: "actor" | "critic" | "reward" | "reference";
  active: boolean;
  trainable: boolean;
  device: string | null;
  why: string;
  name?: string;
}

export interface Diagram {
  models: DiagramModel[];
  flows: { from: string; to: string; label: string }[];
  errors?: FieldError[];
}

export interface RunInfo {
  id: string;
  mode: string;
  status: "queued" | "running" | "finished" | "failed" | "stopped" | "unknown";
  returncode: number | null;
  started: number | null;
  ended: number | null;
  step: number | null;
  total_steps: number | null;
  output_dir: string;
  argv?: string[];
  last_metrics?: Record<string, unknown> | null;
  name?: string | null;
  tags?: string[];
  archived?: boolean;
  duration_s?: number | null;
  /** The effective values of the config keys asked for (`/api/runs?columns=`). */
  columns?: Record<string, unknown>;
}

export interface Comparison {
  /** Each run's curves ([step, value]) and its other x axes ([step, x]: wall_s, tokens). */
  runs: (RunInfo & { curves: Record<string, [number, number][]>; axes?: Record<string, [number, number][]> })[];
  metrics: string[];
  /** Shared metrics with one value throughout (hidden from the picker). */
  constant?: string[];
  config_diff: { path: string; values: Record<string, unknown> }[];
  /** Rewards whose code differs: each run's source and a unified diff against the first run's. */
  reward_code: { name: string; code: Record<string, string | null>; diff: Record<string, string> }[];
}

export interface TrialAnswer {
  path: string;
  text: string;
  tokens: { text: string; logprob: number }[];
  stop: string;
  seconds: number;
  server?: string;
}

/** A model a run can be tried or exported from: "final" or a checkpoint ("step_00000004"). */
export interface ModelSource {
  name: string;
  ready: boolean;
  exported?: boolean;
}

export interface SharedSample {
  step?: number;
  completion: string;
  reward?: number | null;
  advantage?: number | null;
  stop?: string;
  rewards?: Record<string, number | null>;
}

export interface SharedSamples {
  prompts: string[];
  prompt: string | null;
  completions: Record<string, SharedSample[]>;
}

/** A health alarm the trainer wrote to events.jsonl. */
export interface Alarm {
  event: "alarm";
  name: string;
  metric: string;
  value: number;
  threshold: number;
  policy: string;
  message: string;
  step: number;
}

export interface RunStatus {
  status: RunInfo["status"];
  mode?: string;
  returncode: number | null;
  step: number | null;
  total_steps: number | null;
  stage: string | null;
  /** The step the trainer was in when it entered `stage`. */
  stage_step: number | null;
  /** "reported" (the trainer's events.jsonl) or "estimated" (from the last step's timings). */
  stage_source: "reported" | "estimated" | null;
  /** Async runs: each side's current stage, e.g. {"producer": "generate", "trainer": "train"}. */
  sides: Record<string, string>;
  bottleneck: string | null;
}

/** An error from the API, with the route and the server's message (never a bare "failed"). */
// The server's message is shown as it is: it already names the field or route to blame (a route prefix
// here would double it: "/api/estimate: /api/estimate: ...").
export class ApiError extends Error {
  constructor(public route: string, public status: number, message: string, public body?: unknown) {
    super(message);
  }
}

function messageOf(body: unknown, status: number): string {
  if (body && typeof body === "object") {
    const b = body as Record<string, unknown>;
    if (typeof b.error === "string") return b.error;
    if (typeof b.detail === "string") return b.detail;
    if (Array.isArray(b.detail)) return b.detail.map((d) => JSON.stringify(d)).join("; ");
    if (typeof b.message === "string") return b.message;
    if (Array.isArray(b.errors)) return b.errors.map((e) => (e as FieldError).message ?? String(e)).join("; ");
  }
  return `HTTP ${status}`;
}

async function call<T>(method: "GET" | "POST", route: string, body?: unknown, signal?: AbortSignal): Promise<T> {
  let res: Response;
  try {
    res = await fetch(route, {
      method,
      credentials: "same-origin",
      headers: body === undefined ? {} : { "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if ((err as Error).name === "AbortError") throw err; // cancelled by the page: not a server error
    throw new ApiError(route, 0, `${route}: server unreachable (${String(err)})`);
  }
  const text = await res.text();
  let parsed: unknown = undefined;
  try {
    parsed = text ? JSON.parse(text) : undefined;
  } catch {
    parsed = text;
  }
  if (!res.ok) throw new ApiError(route, res.status, messageOf(parsed, res.status), parsed);
  return parsed as T;
}

/** A run id in a URL path: nested folders keep their slashes ("sweep/a"), each name encoded. */
function runPath(id: string): string {
  return id.split("/").map(encodeURIComponent).join("/");
}

export const api = {
  schema: (mode: Mode) => call<Schema>("GET", `/api/schema?mode=${encodeURIComponent(mode)}`),
  presets: (mode: Mode) => call<Preset[]>("GET", `/api/presets?mode=${encodeURIComponent(mode)}`),
  validate: (mode: Mode, config: Config) => call<Validation>("POST", "/api/validate", { mode, config }),
  estimate: (mode: Mode, config: Config, device_memory_gib: number, num_devices: number) =>
    call<Record<string, unknown>>("POST", "/api/estimate", { mode, config, device_memory_gib, num_devices }),
  diagram: (mode: Mode, config: Config) => call<Diagram>("POST", "/api/diagram", { mode, config }),
  placement: (mode: Mode, config: Config) => call<Record<string, unknown>>("POST", "/api/placement", { mode, config }),
  exportYaml: (mode: Mode, config: Config, rewards: RewardDraft[]) =>
    call<{ yaml: string; filename: string; command: string; files: ExportedFile[] }>("POST", "/api/yaml/export", {
      mode,
      config,
      ...(rewards.length ? { rewards } : {}),
    }),
  importYaml: (yaml: string, rewards: RewardDraft[]) =>
    call<{ mode: Mode; config: Config; errors: FieldError[] }>("POST", "/api/yaml/import", {
      yaml,
      ...(rewards.length ? { rewards: rewards.map((r) => ({ name: r.name, function: r.function })) } : {}),
    }),
  preview: (mode: Mode, config: Config, rewards: RewardDraft[], prompts: number, samples: number, signal?: AbortSignal) =>
    call<Preview>("POST", "/api/rewards/preview", { mode, config, rewards, prompts, samples }, signal),
  launch: (mode: Mode, config: Config, rewards?: RewardDraft[], queue = false) =>
    call<{ id: string; argv?: string[]; output_dir: string; status: string; position?: number }>("POST", "/api/runs", {
      mode,
      config,
      ...(rewards && rewards.length ? { rewards } : {}),
      ...(queue ? { queue } : {}),
    }),
  sweep: (mode: Mode, config: Config, rewards: RewardDraft[] | undefined, field: string, values: unknown[]) =>
    call<{ tag: string; runs: { id: string; status: string }[] }>("POST", "/api/sweep", {
      mode, config, field, values, ...(rewards && rewards.length ? { rewards } : {}),
    }),
  stop: (id: string) => call<unknown>("POST", `/api/runs/${runPath(id)}/stop`),
  runs: (columns: string[] = []) =>
    call<{ runs: RunInfo[] }>("GET", columns.length ? `/api/runs?columns=${columns.map(encodeURIComponent).join(",")}` : "/api/runs"),
  labels: (id: string, name: string | null, tags: string[], archived?: boolean) =>
    call<RunInfo>("POST", `/api/runs/${runPath(id)}/labels`, { name, tags, ...(archived === undefined ? {} : { archived }) }),
  compare: (ids: string[]) => call<Comparison>("GET", `/api/compare?ids=${ids.map(encodeURIComponent).join(",")}`),
  compareSamples: (ids: string[], prompt: string | null) =>
    call<SharedSamples>("GET", `/api/compare/samples?ids=${ids.map(encodeURIComponent).join(",")}` +
      (prompt === null ? "" : `&prompt=${encodeURIComponent(prompt)}`)),
  resume: (id: string) => call<{ id: string; status: string }>("POST", `/api/runs/${runPath(id)}/resume`),
  clone: (id: string) => call<{ mode: Mode; config: Config; rewards: RewardDraft[] }>("GET", `/api/runs/${runPath(id)}/clone`),
  tryResult: (id: string, prompt: string, max_tokens: number, source = "final") =>
    call<{ result: TrialAnswer; base: TrialAnswer }>("POST", `/api/runs/${runPath(id)}/try`, { prompt, max_tokens, source }),
  models: (id: string) => call<{ sources: ModelSource[]; servers: string[] }>("GET", `/api/runs/${runPath(id)}/models`),
  exportModel: (id: string, source: string) =>
    call<{ source: string; path: string; adapter: string | null }>("POST", `/api/runs/${runPath(id)}/export`, { source }),
  report: (id: string) => call<{ report: Record<string, unknown> | null }>("GET", `/api/runs/${runPath(id)}/report`),
};

const STREAM_EVENTS = ["metrics", "samples", "status", "log", "stage", "alarm", "efficiency"] as const;
type StreamEvent = (typeof STREAM_EVENTS)[number];

/** Subscribe to a run's live stream; EventSource resends Last-Event-ID (a byte offset) on reconnect. */
export function runEvents(
  id: string,
  on: { [event in StreamEvent]?: (data: any) => void } & { error?: () => void },
): () => void {
  const source = new EventSource(`/api/runs/${runPath(id)}/events`, { withCredentials: true });
  for (const name of STREAM_EVENTS) {
    const handler = on[name];
    if (!handler) continue;
    source.addEventListener(name, (ev) => {
      const raw = (ev as MessageEvent).data;
      let data: unknown = raw;
      try {
        data = JSON.parse(raw);
      } catch {
        /* a log line may be plain text */
      }
      handler(data);
    });
  }
  if (on.error) source.onerror = on.error;
  return () => source.close();
}
