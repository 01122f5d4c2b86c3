// A CodeMirror 6 Python editor; the document is owned by the caller (value / onChange).
import { python } from "@codemirror/lang-python";
import { EditorView, basicSetup } from "codemirror";
import { useEffect, useRef } from "preact/hooks";

export function CodeEditor(props: { value: string; onChange: (code: string) => void; testId: string }) {
  const host = useRef<HTMLDivElement>(null);
  const view = useRef<EditorView | null>(null);
  const onChange = useRef(props.onChange);
  onChange.current = props.onChange;
  useEffect(() => {
    view.current = new EditorView({
      doc: props.value,
      parent: host.current!,
      extensions: [
        basicSetup,
        python(),
        EditorView.updateListener.of((u) => {
          if (u.docChanged) onChange.current(u.state.doc.toString());
        }),
      ],
    });
    return () => view.current?.destroy();
  }, []);
  useEffect(() => {
    // an outside change (a reset, an import) replaces the document; our own edits are already in it
    const v = view.current;
    if (v && v.state.doc.toString() !== props.value) {
      v.dispatch({ changes: { from: 0, to: v.state.doc.length, insert: props.value } });
    }
  }, [props.value]);
  return <div class="editor" data-testid={props.testId} ref={host} />;
}
