// Builds the JavaScript side from protos/ (run by `make web`; output under build/, never committed):
//   build/gen-js/web   TypeScript messages and service descriptor (protoc-gen-es), for the page
//   build/gen-js/node  TypeScript messages and a @grpc/grpc-js client class (ts-proto), for Node
//   build/web          the page: index.html, style.css, app.js (bundled with esbuild)
//   build/node         the Node client example, stream.cjs
// protoc is the one in Python's grpcio-tools (the Python stubs come from it too); the plugins are
// plain JavaScript from npm, so nothing is downloaded from outside the npm registry.
import { execFileSync } from "node:child_process";
import { copyFileSync, mkdirSync, readdirSync, rmSync, statSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const python = process.env.PYTHON || join(root, ".venv", "bin", "python");
const protos = join(root, "protos");
const out = (...p) => join(root, "build", ...p);
const bin = (name) => join(root, "node_modules", ".bin", name);

function protoFiles(dir) {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    return statSync(path).isDirectory() ? protoFiles(path) : name.endsWith(".proto") ? [relative(protos, path)] : [];
  });
}

function protoc(plugin, flag, outDir, options) {
  rmSync(outDir, { recursive: true, force: true });
  mkdirSync(outDir, { recursive: true });
  const include = execFileSync(python, ["-c", "import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), '_proto'))"])
    .toString().trim();
  execFileSync(python, ["-m", "grpc_tools.protoc", `-I${protos}`, `-I${include}`, `--plugin=protoc-gen-${flag}=${bin(plugin)}`,
    `--${flag}_out=${outDir}`, `--${flag}_opt=${options}`, ...protoFiles(protos)], { stdio: "inherit" });
}

protoc("protoc-gen-es", "es", out("gen-js", "web"), "target=ts");
protoc("protoc-gen-ts_proto", "ts_proto", out("gen-js", "node"),
  "outputServices=grpc-js,env=node,esModuleInterop=true,forceLong=number");

mkdirSync(out("web"), { recursive: true });
for (const name of ["index.html", "style.css"]) copyFileSync(join(root, "client", "web", name), out("web", name));
await esbuild.build({
  entryPoints: [join(root, "client", "web", "main.ts")], outfile: out("web", "app.js"),
  bundle: true, format: "esm", target: "es2022", minify: true, logLevel: "warning",
});
await esbuild.build({
  entryPoints: [join(root, "client", "node", "stream.ts")], outfile: out("node", "stream.cjs"),
  bundle: true, platform: "node", format: "cjs", target: "node20", packages: "external", logLevel: "warning",
});
