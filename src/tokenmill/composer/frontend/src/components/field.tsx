// One config field rendered from its schema entry: the input matches the type, the field's
// documentation is the help text (under the field and on hover), a validation error sits inline.
import { useEffect, useState } from "preact/hooks";
import type { SchemaField } from "../api";

interface Props {
  field: SchemaField;
  value: unknown;
  error?: string;
  onChange: (value: unknown) => void; // undefined = remove the key (the default applies)
}

const testId = (path: string) => `field-${path}`;

function display(value: unknown): string {
  if (value === undefined || value === null) return "";
  return typeof value === "string" ? value : JSON.stringify(value);
}

function JsonInput({ field, value, onChange }: Props) {
  const shown = value === undefined ? field.default : value;
  const [text, setText] = useState(JSON.stringify(shown ?? null, null, 0));
  const [bad, setBad] = useState<string | null>(null);
  useEffect(() => setText(JSON.stringify(shown ?? null, null, 0)), [JSON.stringify(shown)]);
  const commit = () => {
    try {
      onChange(text.trim() === "" ? undefined : JSON.parse(text));
      setBad(null);
    } catch (err) {
      setBad(`not valid JSON: ${(err as Error).message}`);
    }
  };
  return (
    <>
      <textarea
        class="input mono"
        rows={2}
        data-testid={testId(field.path)}
        aria-label={field.path}
        value={text}
        onInput={(e) => setText((e.target as HTMLTextAreaElement).value)}
        onBlur={commit}
      />
      {bad && <div class="field-error">{bad}</div>}
    </>
  );
}

function parseNumber(raw: string, empty: unknown): unknown {
  if (raw.trim() === "") return empty;
  const num = Number(raw.trim());
  return Number.isFinite(num) ? num : raw.trim(); // not a number: the server's error names the field
}

/** A text box that keeps what is typed ("0.", "1e-") while the config holds the parsed number; not
 * type=number, which reports "" for such partial input. */
function NumberInput({ field, value, onChange, empty }: Props & { empty: unknown }) {
  const [text, setText] = useState(display(value));
  useEffect(() => {
    if (parseNumber(text, empty) !== value) setText(display(value)); // changed elsewhere: a preset, an import
  }, [value]);
  return (
    <input
      class="input mono"
      type="text"
      inputMode={field.type === "integer" ? "numeric" : "decimal"}
      data-testid={`field-${field.path}`}
      aria-label={field.path}
      placeholder={display(field.default)}
      value={text}
      onInput={(e) => {
        const raw = (e.target as HTMLInputElement).value;
        setText(raw);
        onChange(parseNumber(raw, empty));
      }}
    />
  );
}

function Control(props: Props) {
  const { field, value, onChange } = props;
  const id = testId(field.path);
  const nullable = Boolean(field.nullable) || (field.enum ?? []).includes(null);
  // emptied: drop the key (the default applies) unless null is a real choice that differs from the default
  const empty = nullable && field.default !== null ? null : undefined;
  if (field.type === "boolean") {
    const checked = Boolean(value === undefined ? field.default : value);
    return (
      <label class="switch">
        <input
          type="checkbox"
          data-testid={id}
          aria-label={field.path}
          checked={checked}
          onChange={(e) => onChange((e.target as HTMLInputElement).checked)}
        />
        <span>{checked ? "on" : "off"}</span>
      </label>
    );
  }
  if (field.type === "enum" && field.enum) {
    const current = value === undefined ? field.default : value;
    return (
      <select
        class="input"
        data-testid={id}
        aria-label={field.path}
        value={display(current)}
        onChange={(e) => {
          const raw = (e.target as HTMLSelectElement).value;
          const match = field.enum!.find((opt) => display(opt) === raw);
          onChange(raw === "" && nullable ? null : match);
        }}
      >
        {nullable && <option value="">(none)</option>}
        {field.enum.filter((opt) => opt !== null).map((opt) => (
          <option value={display(opt)}>{display(opt)}</option>
        ))}
      </select>
    );
  }
  if (field.type === "integer" || field.type === "number") return <NumberInput {...props} empty={empty} />;
  if (field.type === "list" || field.type === "object" || field.type === "json") return <JsonInput {...props} />;
  return (
    <input
      class="input"
      type="text"
      data-testid={id}
      aria-label={field.path}
      placeholder={display(field.default)}
      value={display(value)}
      onInput={(e) => {
        const raw = (e.target as HTMLInputElement).value;
        onChange(raw === "" ? empty : raw);
      }}
    />
  );
}

export function Field(props: Props) {
  const { field, error } = props;
  const name = field.path.split(".").slice(-1)[0];
  return (
    <div class={`field${error ? " has-error" : ""}`} data-testid={`row-${field.path}`} title={field.description}>
      <div class="field-label">
        <span class="field-name">{name}</span>
        {field.required && <span class="required">required</span>}
        <span class="field-path mono">{field.path}</span>
      </div>
      <Control {...props} />
      {field.description && <div class="help">{field.description}</div>}
      {error && (
        <div class="field-error" data-testid={`error-${field.path}`}>
          {error}
        </div>
      )}
    </div>
  );
}
