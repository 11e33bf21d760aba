// Validates deploy/*.yaml against the Kubernetes schemas (kubernetes-models) and checks what a
// schema cannot: the kvtrie container's flags and config-file settings exist in the built
// `kvtrie-server --help`; its memory limit holds the hot tier plus the Put buffers; probes are
// gRPC health checks on a plaintext port; mounts, ConfigMaps, Secrets and Services refer to
// things that exist. Then checks the Dockerfile: stages, non-root user, volume, entrypoint flags
// and that the runtime stage installs the package of every library the server links directly.
//
//   node validate.js BUILD_DIR        (exit 0: all good; 1: the problems are printed)
"use strict";
const fs = require("fs");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");

const root = path.resolve(__dirname, "../..");
const buildDir = path.resolve(process.argv[2] || path.join(root, "build"));
const serverBin = path.join(buildDir, "server/kvtrie-server");
const problems = [];
const fail = (where, what) => problems.push(`${where}: ${what}`);

// --- the server's flags and defaults, from --help ------------------------------------------
let help = "";
try {
  help = execFileSync(serverBin, ["--help"], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
} catch (e) {
  help = String(e.stdout || "") + String(e.stderr || "");  // absl's --help exits 1
}
const flags = {};  // name -> default (string)
for (const entry of help.split(/\n(?=\s+--[a-z0-9_]+ \()/)) {
  const m = /^\s+--([a-z0-9_]+) \(/.exec(entry);
  const d = /default: ([^;]*);/.exec(entry);
  if (m && d) flags[m[1]] = d[1].replace(/\s+/g, " ").replace(/^"(.*)"$/, "$1");
}
if (Object.keys(flags).length < 20) fail(serverBin, `--help lists only ${Object.keys(flags).length} flags`);

const BYTE_UNITS = { TiB: 2 ** 40, GiB: 2 ** 30, MiB: 2 ** 20, KiB: 2 ** 10, kiB: 2 ** 10, TB: 1e12,
  GB: 1e9, MB: 1e6, kB: 1e3, KB: 1e3, B: 1 };
function byteSize(text) {  // server/byte_size.h
  const m = /^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$/.exec(String(text));
  if (!m || (m[2] && !(m[2] in BYTE_UNITS))) return NaN;
  return Math.floor(Number(m[1]) * (m[2] ? BYTE_UNITS[m[2]] : 1));
}
const QUANTITY = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, k: 1e3, M: 1e6, G: 1e9, T: 1e12, "": 1 };
function quantity(text) {  // Kubernetes resource quantities (the memory ones)
  const m = /^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$/.exec(String(text));
  return m ? Number(m[1]) * QUANTITY[m[2] || ""] : NaN;
}

// --- manifests -----------------------------------------------------------------------------
const MODELS = {
  "v1/ConfigMap": require("kubernetes-models/v1/ConfigMap").ConfigMap,
  "v1/Secret": require("kubernetes-models/v1/Secret").Secret,
  "v1/Service": require("kubernetes-models/v1/Service").Service,
  "v1/PersistentVolumeClaim": require("kubernetes-models/v1/PersistentVolumeClaim").PersistentVolumeClaim,
  "apps/v1/Deployment": require("kubernetes-models/apps/v1/Deployment").Deployment,
  "apps/v1/StatefulSet": require("kubernetes-models/apps/v1/StatefulSet").StatefulSet,
  "policy/v1/PodDisruptionBudget": require("kubernetes-models/policy/v1/PodDisruptionBudget").PodDisruptionBudget,
};
// The Debian package of every library kvtrie-server links directly, less the base image's
// (libc, libstdc++, libgcc): the runtime stage of the Dockerfile must install each.
const BASE = new Set(["libc6", "libstdc++6", "libgcc-s1"]);
const LINKED = [];  // {lib, pkg} or {error}
try {
  const needed = execFileSync("readelf", ["-d", serverBin], { encoding: "utf8" })
    .split("\n").map((l) => /\(NEEDED\).*\[(.+)\]/.exec(l)).filter(Boolean).map((m) => m[1]);
  const ldconfig = execFileSync("/sbin/ldconfig", ["-p"], { encoding: "utf8" });
  for (const lib of needed) {
    const m = new RegExp(`\\s${lib.replace(/[.+]/g, "\\$&")} \\(libc6,x86-64[^)]*\\) => (\\S+)`).exec(ldconfig);
    if (!m) { LINKED.push({ error: `cannot resolve ${lib}` }); continue; }
    const real = fs.realpathSync(m[1]);
    let owner = "";
    for (const p of [real, real.replace(/^\/usr\/lib\//, "/lib/")]) {  // merged /usr
      try {
        owner = execFileSync("dpkg", ["-S", p], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
        break;
      } catch (e) { /* try the next path */ }
    }
    if (!owner) { LINKED.push({ error: `no package owns ${real} (for ${lib})` }); continue; }
    const pkg = owner.split(":")[0];
    if (!BASE.has(pkg)) LINKED.push({ lib, pkg });
  }
} catch (e) {
  LINKED.push({ error: `checking linked libraries: ${e.message}` });
}
if (LINKED.length < 5) problems.push(`${serverBin}: only ${LINKED.length} linked libraries found`);

// Every check of the manifests (file name -> YAML text) and the Dockerfile text; returns the
// problems found.
function checkAll(manifests, dockerfile) {
const problems = [];
const fail = (where, what) => problems.push(`${where}: ${what}`);
const files = Object.keys(manifests).sort();
if (files.length < 4) fail("deploy/", `only ${files.length} manifests`);
const docs = [];  // {file, obj}
for (const f of files) {
  for (const d of YAML.parseAllDocuments(manifests[f])) {
    if (d.errors.length) { fail(f, d.errors[0].message); continue; }
    const obj = d.toJS();
    if (obj == null) continue;
    const where = `${f} ${obj.kind}/${obj.metadata && obj.metadata.name}`;
    const Model = MODELS[`${obj.apiVersion}/${obj.kind}`];
    if (!Model) { fail(where, `no schema for ${obj.apiVersion} ${obj.kind}`); continue; }
    try {
      new Model(obj).validate();
    } catch (e) {
      fail(where, `schema: ${e.message}`);
      continue;
    }
    docs.push({ file: f, where, obj });
  }
}
const find = (kind, name) => docs.find((d) => d.obj.kind === kind && d.obj.metadata.name === name);
const kinds = new Set(docs.map((d) => d.obj.kind));
for (const k of ["Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"]) {
  if (!kinds.has(k)) fail("deploy/", `no ${k}`);
}
if (!docs.some((d) => d.obj.kind === "StatefulSet" && (d.obj.spec.volumeClaimTemplates || []).length)) {
  fail("deploy/", "no StatefulSet with a volumeClaimTemplate");
}

function portOf(listen) { const m = /:(\d+)$/.exec(listen || ""); return m ? Number(m[1]) : NaN; }

for (const { where, obj } of docs.filter((d) => ["Deployment", "StatefulSet"].includes(d.obj.kind))) {
  const pod = obj.spec.template.spec;
  const volumes = Object.fromEntries((pod.volumes || []).map((v) => [v.name, v]));
  const claimNames = new Set((obj.spec.volumeClaimTemplates || []).map((c) => c.metadata.name));
  const kv = pod.containers.find((c) => c.name === "kvtrie");
  if (!kv) { fail(where, "no container named kvtrie"); continue; }
  const w = `${where} container kvtrie`;
  // Effective settings: defaults <- config file <- args.
  const settings = { ...flags };
  const args = kv.args || [];
  const argSettings = {};
  for (const a of args) {
    const m = /^--([a-z0-9_]+)(?:=(.*))?$/.exec(a);
    if (!m) { fail(w, `arg '${a}' is not --name=value`); continue; }
    if (!(m[1] in flags)) fail(w, `arg --${m[1]} is not a kvtrie-server flag`);
    argSettings[m[1]] = m[2] === undefined ? "true" : m[2];
  }
  const mounts = kv.volumeMounts || [];
  const mountFor = (file) => mounts.filter((m) => file === m.mountPath || file.startsWith(m.mountPath + "/"))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  // A volume item's file: the Secret or ConfigMap key behind `file`, checked to exist.
  function checkFile(file, what) {
    const m = mountFor(file);
    if (!m) return fail(w, `${what} ${file} is on no volume mount`);
    const v = volumes[m.name];
    if (!v && !claimNames.has(m.name)) return fail(w, `mount ${m.name} has no volume`);
    const source = v && (v.secret ? ["Secret", v.secret.secretName] : v.configMap ? ["ConfigMap", v.configMap.name] : null);
    if (!source) return null;
    const doc = find(source[0], source[1]);
    if (!doc) return fail(w, `${what}: ${source[0]} ${source[1]} is not in deploy/`);
    const rel = m.subPath || path.relative(m.mountPath, file);
    const items = (v.secret || v.configMap).items;
    const key = items ? (items.find((i) => i.path === rel) || {}).key : rel;
    const data = { ...(doc.obj.data || {}), ...(doc.obj.stringData || {}) };
    if (!key || !(key in data)) return fail(w, `${what} ${file}: no key '${rel}' in ${source[0]} ${source[1]}`);
    return data[key];
  }
  if (argSettings.config) {
    const text = checkFile(argSettings.config, "--config");
    if (typeof text === "string") {
      text.split("\n").forEach((line, i) => {
        line = line.trim();
        if (!line || line.startsWith("#")) return;
        const m = /^([a-z0-9_]+)\s*=\s*(.*)$/.exec(line);
        if (!m) return fail(w, `config line ${i + 1} '${line}' is not 'name = value'`);
        if (!(m[1] in flags)) return fail(w, `config setting '${m[1]}' is not a kvtrie-server flag`);
        settings[m[1]] = m[2].replace(/^"(.*)"$/, "$1");
      });
    }
  }
  Object.assign(settings, argSettings);
  // Memory: the limit holds the hot tier, the Put buffers, two memtables and 512 MiB of the rest.
  const need = ["memory_bytes", "max_inflight_put_bytes", "memtable_bytes"].map((n) => byteSize(settings[n]));
  if (need.some(Number.isNaN)) fail(w, `cannot read the byte sizes ${JSON.stringify(need)}`);
  const [hot, inflight, memtable] = need;
  const want = hot + inflight + 2 * memtable + 512 * 2 ** 20;
  const res = kv.resources || {};
  const limit = quantity((res.limits || {}).memory);
  const request = quantity((res.requests || {}).memory);
  if (!(limit >= want)) fail(w, `memory limit ${(res.limits || {}).memory} < memory_bytes + max_inflight_put_bytes + 2 x memtable_bytes + 512Mi = ${(want / 2 ** 30).toFixed(2)}Gi`);
  if (!(request >= hot)) fail(w, `memory request ${(res.requests || {}).memory} < memory_bytes ${settings.memory_bytes}`);
  // Ports and probes: gRPC health on the plaintext port (Kubernetes probes cannot speak TLS).
  const ports = Object.fromEntries((kv.ports || []).map((p) => [p.name, p.containerPort]));
  const containerPorts = new Set(Object.values(ports));
  const grpcPort = portOf(settings.listen);
  const tls = !!settings.tls_cert;
  const probePort = tls ? portOf(settings.health_listen) : grpcPort;
  if (!containerPorts.has(grpcPort)) fail(w, `listen port ${grpcPort} is not a containerPort`);
  if (tls && Number.isNaN(probePort)) fail(w, "TLS is on but no --health_listen port for the probes");
  if (settings.metrics_listen && !containerPorts.has(portOf(settings.metrics_listen))) {
    fail(w, `metrics port ${portOf(settings.metrics_listen)} is not a containerPort`);
  }
  for (const probe of ["readinessProbe", "livenessProbe", "startupProbe"]) {
    const p = kv[probe];
    if (!p || !p.grpc) { fail(w, `${probe} is not a grpc probe`); continue; }
    if (p.grpc.port !== probePort) fail(w, `${probe} on port ${p.grpc.port}, health is served on ${probePort}`);
    if (p.grpc.service && !["kvtrie.v1.KVCache", ""].includes(p.grpc.service)) fail(w, `${probe} service ${p.grpc.service}`);
  }
  // Files the server reads are mounted.
  if (!mountFor(settings.data_dir)) fail(w, `data_dir ${settings.data_dir} is on no volume mount`);
  for (const f of ["tls_cert", "tls_key", "tls_client_ca", "tokens_file"]) {
    if (settings[f]) checkFile(settings[f], `--${f}`);
  }
  const grace = Number(pod.terminationGracePeriodSeconds || 30);
  if (!(grace > Number(settings.shutdown_grace_seconds))) {
    fail(w, `terminationGracePeriodSeconds ${grace} <= shutdown_grace_seconds ${settings.shutdown_grace_seconds}`);
  }
  obj._ports = ports;
}
// Services select a pod template and name its ports.
for (const { where, obj } of docs.filter((d) => d.obj.kind === "Service")) {
  const sel = obj.spec.selector || {};
  const target = docs.find((d) => ["Deployment", "StatefulSet"].includes(d.obj.kind) &&
    Object.entries(sel).every(([k, v]) => (d.obj.spec.template.metadata.labels || {})[k] === v));
  if (!target) { fail(where, `selector ${JSON.stringify(sel)} matches no pod template`); continue; }
  for (const p of obj.spec.ports) {
    if (typeof p.targetPort === "string" && !(p.targetPort in (target.obj._ports || {}))) {
      fail(where, `targetPort ${p.targetPort} is not a port of ${target.where}`);
    }
  }
}
for (const { where, obj } of docs.filter((d) => d.obj.kind === "StatefulSet")) {
  if (!find("Service", obj.spec.serviceName)) fail(where, `serviceName ${obj.spec.serviceName} is not a Service`);
  // Shards (issue 21): each pod's /metrics carries its stable name (--shard_name or $POD_NAME
  // from metadata.name), and a PodDisruptionBudget lets a drain take one shard at a time.
  const kv = obj.spec.template.spec.containers.find((c) => c.name === "kvtrie") || {};
  const podName = (kv.env || []).find((e) => e.name === "POD_NAME");
  const named = (kv.args || []).some((a) => a.startsWith("--shard_name=")) ||
    (podName && podName.valueFrom && podName.valueFrom.fieldRef &&
     podName.valueFrom.fieldRef.fieldPath === "metadata.name");
  if (!named) fail(where, "no shard name: set env POD_NAME from metadata.name (or --shard_name)");
  const labels = obj.spec.template.metadata.labels || {};
  const pdbs = docs.filter((d) => d.obj.kind === "PodDisruptionBudget" &&
    Object.entries((d.obj.spec.selector || {}).matchLabels || {}).every(([k, v]) => labels[k] === v));
  if (!pdbs.length) fail(where, "no PodDisruptionBudget selects its pods");
  for (const p of pdbs) {
    const replicas = Number(obj.spec.replicas || 1);
    const min = p.obj.spec.minAvailable, max = p.obj.spec.maxUnavailable;
    if ((typeof min === "number" && min >= replicas) || max === 0 || max === "0%") {
      fail(p.where, `allows no voluntary eviction of ${replicas} replicas (a drain would hang)`);
    }
  }
}

// --- Dockerfile ----------------------------------------------------------------------------
const instructions = [];
{
  let cur = "";
  for (const raw of dockerfile.split("\n")) {
    const line = raw.replace(/^\s+/, "");
    if (!cur && (line === "" || line.startsWith("#"))) continue;
    if (line.startsWith("#")) continue;
    cur += (cur ? " " : "") + line.replace(/\\$/, "").trim();
    if (!/\\\s*$/.test(raw)) {
      const m = /^([A-Za-z]+)\s+(.*)$/.exec(cur);
      if (m) instructions.push({ op: m[1].toUpperCase(), arg: m[2] });
      cur = "";
    }
  }
}
const stages = [];
for (const ins of instructions) {
  if (ins.op === "FROM") {
    const m = /^(\S+)(?:\s+AS\s+(\S+))?$/i.exec(ins.arg);
    stages.push({ image: m[1], name: m[2] || String(stages.length), ins: [] });
  } else if (stages.length) {
    stages[stages.length - 1].ins.push(ins);
  } else {
    fail("Dockerfile", `${ins.op} before FROM`);
  }
}
const D = "Dockerfile";
if (stages.length < 2) fail(D, `${stages.length} stage(s); want a build stage and a runtime stage`);
const final = stages[stages.length - 1] || { ins: [] };
const op = (name) => final.ins.filter((i) => i.op === name);
if (!final.ins.some((i) => i.op === "COPY" && /--from=(\S+)/.test(i.arg) &&
    stages.slice(0, -1).some((s) => s.name === /--from=(\S+)/.exec(i.arg)[1]))) {
  fail(D, "the runtime stage copies nothing from an earlier stage");
}
const users = op("USER");
const user = users.length ? users[users.length - 1].arg.trim() : "root";
if (/^(root|0)(:|$)/.test(user)) fail(D, `the runtime stage runs as ${user}`);
const volumes = op("VOLUME").flatMap((v) => v.arg.startsWith("[") ? JSON.parse(v.arg) : v.arg.split(/\s+/));
const entry = op("ENTRYPOINT");
let entryArgs = [];
try {
  entryArgs = JSON.parse(entry[entry.length - 1].arg);
} catch (e) {
  fail(D, "ENTRYPOINT is not in exec (JSON array) form");
}
if (!/kvtrie-server$/.test(entryArgs[0] || "")) fail(D, `ENTRYPOINT runs ${entryArgs[0]}`);
const entrySettings = {};
for (const a of entryArgs.slice(1)) {
  const m = /^--([a-z0-9_]+)(?:=(.*))?$/.exec(a);
  if (!m || !(m[1] in flags)) fail(D, `ENTRYPOINT arg '${a}' is not a kvtrie-server flag`);
  else entrySettings[m[1]] = m[2];
}
if (!volumes.includes(entrySettings.data_dir)) fail(D, `data_dir ${entrySettings.data_dir} is not a VOLUME (${volumes})`);
const exposed = op("EXPOSE").flatMap((e) => e.arg.split(/\s+/)).map((p) => Number(p.split("/")[0]));
if (!exposed.includes(portOf(entrySettings.listen))) fail(D, `listen port ${portOf(entrySettings.listen)} is not EXPOSEd`);
// Every library kvtrie-server links directly comes from a package the runtime stage installs
// (or from the base image: libc, libstdc++, libgcc).
const runText = op("RUN").map((r) => r.arg).join(" ");
for (const { lib, pkg, error } of LINKED) {
  if (error) fail(D, error);
  else if (!new RegExp(`(^|\\s)${pkg.replace(/[.+]/g, "\\$&")}(\\s|$)`).test(runText)) {
    fail(D, `the runtime stage does not install ${pkg} (for ${lib})`);
  }
}

return { problems, summary: `${docs.length} manifests in ${files.length} files, Dockerfile with ${stages.length} stages` };
}

const deployDir = path.join(root, "deploy");
const manifests = Object.fromEntries(fs.readdirSync(deployDir).filter((f) => /\.ya?ml$/.test(f))
  .map((f) => [f, fs.readFileSync(path.join(deployDir, f), "utf8")]));
const dockerfile = fs.readFileSync(path.join(root, "Dockerfile"), "utf8");
const result = checkAll(manifests, dockerfile);
problems.push(...result.problems);

// Self-test: each broken copy must be caught, with a problem that names it.
const MUTATIONS = [
  ["kvtrie-standalone.yaml", "limits: {memory: 8Gi}", "limits: {memory: 6Gi}", "memory limit 6Gi <"],
  ["kvtrie-config.yaml", "memory_bytes = 6GiB", "memroy_bytes = 6GiB", "'memroy_bytes' is not a kvtrie-server flag"],
  ["kvtrie-statefulset.yaml", "--memory_bytes=3GiB", "--memory_bytes=5GiB", "memory limit 5Gi <"],
  ["kvtrie-standalone.yaml", "grpc: {port: 8081, service", "grpc: {port: 50051, service", "readinessProbe on port 50051"],
  ["kvtrie-sidecar.yaml", "--default_encoding=lossless", "--default_encodin=lossless", "--default_encodin is not"],
  ["kvtrie-sidecar.yaml", "containerPort: 50051}", "containerPort: \"50051\"}", "schema"],
  ["kvtrie-standalone.yaml", "targetPort: metrics}", "targetPort: metricz}", "targetPort metricz"],
  ["kvtrie-config.yaml", "  tokens.json: |", "  tokens.jsn: |", "no key 'tokens.json'"],
  ["kvtrie-statefulset.yaml", "serviceName: kvtrie-headless", "serviceName: kvtrie-nope", "serviceName kvtrie-nope"],
  ["kvtrie-statefulset.yaml", "fieldRef: {fieldPath: metadata.name}", "fieldRef: {fieldPath: metadata.uid}", "no shard name"],
  ["kvtrie-statefulset.yaml", "maxUnavailable: 1", "maxUnavailable: 0", "allows no voluntary eviction"],
  ["kvtrie-statefulset.yaml", "maxUnavailable: 1\n  selector:\n    matchLabels: {app: kvtrie-sharded}",
   "maxUnavailable: 1\n  selector:\n    matchLabels: {app: kvtrie-other}", "no PodDisruptionBudget selects"],
  ["Dockerfile", "USER kvtrie", "USER root", "runs as root"],
  ["Dockerfile", "VOLUME /var/lib/kvtrie", "VOLUME /data", "is not a VOLUME"],
  ["Dockerfile", "\"--data_dir=/var/lib/kvtrie\"", "\"--data_dir=/var/lib/kvtrie\", \"--no_such_flag=1\"", "--no_such_flag=1' is not"],
  ["Dockerfile", "libprometheus-cpp-pull1.0 ", "", "does not install libprometheus-cpp-pull1.0"],
  ["Dockerfile", "FROM debian:12-slim", "", "stage"],
];
for (const [file, from, to, want] of MUTATIONS) {
  const text = file === "Dockerfile" ? dockerfile : manifests[file];
  if (!text.includes(from)) { problems.push(`self-test: '${from}' is not in ${file}`); continue; }
  const broken = text.replace(from, to);
  const r = file === "Dockerfile" ? checkAll(manifests, broken) : checkAll({ ...manifests, [file]: broken }, dockerfile);
  if (!r.problems.some((p) => p.includes(want))) {
    problems.push(`self-test: ${file} with '${to}' for '${from}' was not caught as '${want}' (${r.problems.join("; ") || "no problem"})`);
  }
}

if (problems.length) {
  console.error(problems.map((p) => "  " + p).join("\n"));
  console.error(`${problems.length} problem(s) in deploy/ and the Dockerfile`);
  process.exit(1);
}
console.log(`ok: ${result.summary}; ${MUTATIONS.length} broken copies all caught`);
