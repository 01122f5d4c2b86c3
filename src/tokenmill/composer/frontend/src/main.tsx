// The Composer's single-page app: a sidebar with the five pages, hash routing (#/compose, #/watch/<id>).
import { render } from "preact";
import { useEffect } from "preact/hooks";
import "uplot/dist/uPlot.min.css";
import "./app.css";
import { MODE_TITLES } from "./pages/compose";
import { ComposePage } from "./pages/compose";
import { ModelsPage } from "./pages/models";
import { RewardsPage } from "./pages/rewards";
import { RunsPage } from "./pages/runs";
import { WatchPage } from "./pages/watch";
import { navigate, pageFromHash, update, useStore } from "./store";
import type { Page } from "./store";

const PAGES: { id: Page; title: string; icon: string }[] = [
  { id: "compose", title: "Compose", icon: "M4 5h16M4 12h16M4 19h10" },
  { id: "rewards", title: "Rewards", icon: "M12 3l2.6 5.6 6.1.7-4.5 4.2 1.2 6L12 16.6 6.6 19.5l1.2-6L3.3 9.3l6.1-.7z" },
  { id: "models", title: "Models & memory", icon: "M4 4h7v7H4zM13 4h7v7h-7zM4 13h7v7H4zM13 13h7v7h-7z" },
  { id: "watch", title: "Watch", icon: "M3 17l5-6 4 4 8-10" },
  { id: "runs", title: "Runs", icon: "M5 6h14M5 12h14M5 18h14" },
];

function App() {
  const s = useStore();
  useEffect(() => {
    const sync = () => update(pageFromHash());
    sync();
    window.addEventListener("hashchange", sync);
    return () => window.removeEventListener("hashchange", sync);
  }, []);
  return (
    <div class="shell">
      <nav class="sidebar">
        <div class="brand">
          <span class="logo">tm</span>
          <div>
            <div class="brand-name">tokenmill</div>
            <div class="brand-sub">Composer</div>
          </div>
        </div>
        {PAGES.map((p) => (
          <a
            href={`#/${p.id}`}
            class={`nav${s.page === p.id ? " active" : ""}`}
            data-testid={`nav-${p.id}`}
            onClick={(e) => {
              e.preventDefault();
              navigate(p.id, p.id === "watch" ? s.runId ?? undefined : undefined);
            }}
          >
            <svg viewBox="0 0 24 24" class="nav-icon" aria-hidden="true">
              <path d={p.icon} />
            </svg>
            {p.title}
          </a>
        ))}
        <div class="sidebar-foot">
          <div class="muted small">mode</div>
          <div data-testid="sidebar-mode">{MODE_TITLES[s.mode]}</div>
          {s.runId && (
            <>
              <div class="muted small">run</div>
              <div class="mono small">{s.runId}</div>
            </>
          )}
        </div>
      </nav>
      <main class="content">
        {s.page === "compose" && <ComposePage />}
        {s.page === "rewards" && <RewardsPage />}
        {s.page === "models" && <ModelsPage />}
        {s.page === "watch" && <WatchPage />}
        {s.page === "runs" && <RunsPage />}
      </main>
    </div>
  );
}

render(<App />, document.getElementById("app")!);
