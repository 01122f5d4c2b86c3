// A CodeMirror 6 Python editor; the document is owned by the caller (value / onChange).
//
// The editor's own edits go out through onChange and come back as props.value; only a value the editor did
// not write (a reset, an import, a reload) is dispatched into it. That check runs in a layout effect, with
// this render's value: a passive effect (useEffect) left pending is flushed by Preact at the start of the
// next render with the value of the render before, so a multi-line insertion that reaches CodeMirror as two
// transactions (an IME commit, a paste, Playwright's insert_text) used to dispatch the stale first half back
// over the second, from inside the page's render, while CodeMirror still had DOM changes to read: the
// gutter's marker loop then never ended and the tab froze.
import { python } from "@codemirror/lang-python";
import { EditorView, basicSetup } from "codemirror";
import { useEffect, useLayoutEffect, useRef } from "preact/hooks";

/** Multi-line text inserted by one input event (an IME commit, dictation, an automation's insertText) goes in
 * as one transaction, as a paste does: left to the browser, a 2,000-line block became a DOM mutation that
 * CodeMirror read back line by line, blocking the page for seconds. */
function insertAsTransaction(e: InputEvent, view: EditorView): boolean {
  if ((e.inputType !== "insertText" && e.inputType !== "insertReplacementText") || !e.data || !e.data.includes("\n")) return false;
  e.preventDefault();
  view.dispatch({ ...view.state.replaceSelection(e.data), userEvent: "input.paste", scrollIntoView: true });
  return true;
}

export function CodeEditor(props: { value: string; onChange: (code: string) => void; testId: string; label: string }) {
  const host = useRef<HTMLDivElement>(null);
  const view = useRef<EditorView | null>(null);
  const emitted = useRef(props.value); // the last document this editor sent out
  const onChange = useRef(props.onChange);
  onChange.current = props.onChange;
  useEffect(() => {
    view.current = new EditorView({
      doc: props.value,
      parent: host.current!,
      extensions: [
        basicSetup,
        python(),
        EditorView.contentAttributes.of({ "aria-label": props.label }),
        EditorView.domEventHandlers({ beforeinput: insertAsTransaction }),
        EditorView.updateListener.of((u) => {
          if (!u.docChanged) return;
          emitted.current = u.state.doc.toString();
          onChange.current(emitted.current);
        }),
      ],
    });
    return () => view.current?.destroy();
  }, []);
  useLayoutEffect(() => {
    const v = view.current;
    if (!v || props.value === emitted.current || v.state.doc.toString() === props.value) return;
    emitted.current = props.value;
    v.dispatch({ changes: { from: 0, to: v.state.doc.length, insert: props.value } });
  }, [props.value]);
  return <div class="editor" data-testid={props.testId} ref={host} />;
}
