// Bundle the Composer's single-page app into ../static/ (index.html, app.js, app.css), minified.
// `node build.mjs --outdir DIR` writes elsewhere: the bundle test builds into a temporary folder and
// compares byte for byte with the committed files, so the output must be deterministic (no timestamps).
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const flag = process.argv.indexOf("--outdir");
const outdir = flag > 0 ? resolve(process.argv[flag + 1]) : join(here, "..", "static");
mkdirSync(outdir, { recursive: true });

await build({
  entryPoints: { app: join(here, "src", "main.tsx") },
  outdir,
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2020"],
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "eof",
  charset: "utf8",
  logLevel: "warning",
});
copyFileSync(join(here, "src", "index.html"), join(outdir, "index.html"));
console.log(`composer bundle written to ${outdir}`);
