// The dashboard: GET /stats once a second while the page is visible (a hidden tab asks nothing), drawn as tiles,
// two charts of the last five minutes and a table of the live sequences.
import { KeyNeeded, api, el, errorText, setUpKeyDialog, whenKeySaved } from "./common.js";

const $ = (id) => document.getElementById(id);
const PERIOD_MS = 1000;
const RATE_WINDOW_S = 5; // the tiles' tokens/s: the mean of the last whole seconds
let timer = null; // the next poll's, when one is due
let polling = false; // a request is out: one loop at a time, however poll() was called

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(0)} ms` : `${value.toFixed(2)} s`;
}

function percent(value) {
  return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`;
}

function mean(values) {
  return values.reduce((a, b) => a + b, 0) / Math.max(values.length, 1);
}

function drawChart(svg, values, className) {
  const width = 600, height = 150, top = 12, bottom = 18;
  const peak = Math.max(1, ...values);
  const x = (i) => (i / Math.max(values.length - 1, 1)) * width;
  const y = (v) => top + (height - top - bottom) * (1 - v / peak);
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("class", className);
  line.setAttribute("points", values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
  const axis = document.createElementNS(ns, "line");
  axis.setAttribute("class", "axis");
  for (const [k, v] of [["x1", 0], ["x2", width], ["y1", y(0)], ["y2", y(0)]]) axis.setAttribute(k, v);
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 4);
  label.setAttribute("y", 11);
  label.textContent = `peak ${Math.round(peak)}`;
  const ago = document.createElementNS(ns, "text");
  ago.setAttribute("x", 4);
  ago.setAttribute("y", height - 4);
  ago.textContent = `${values.length} s ago`;
  const now = document.createElementNS(ns, "text");
  now.setAttribute("x", width - 26);
  now.setAttribute("y", height - 4);
  now.textContent = "now";
  svg.replaceChildren(axis, line, label, ago, now);
}

let shownModel = null; // the model whose engine the tiles show (null: the server's first loaded one)

function showModels(stats) {
  // Several models: each one's state, memory and loads; a click on one shows its engine.
  $("models-table").hidden = stats.models.length < 2;
  const mib = (bytes) => (bytes === null ? "–" : (bytes / 2 ** 20).toFixed(0));
  $("models").replaceChildren(...stats.models.map((m) => {
    const row = el("tr", m.id === stats.model ? "shown" : "");
    for (const cell of [m.id, m.state, mib(m.memory_bytes), m.loads, m.load_seconds ?? "–", m.idle_seconds ?? "–"]) {
      row.append(el("td", "", String(cell)));
    }
    row.addEventListener("click", () => { shownModel = m.id; poll(); });
    return row;
  }));
  const memory = stats.memory;
  return ` · models hold ${mib(memory.used_bytes)} of ${mib(memory.budget_bytes)} MiB`;
}

function showTenants(tenants) {
  // With keys: each tenant's sequences and its share of the tokens served recently (what the fair share weighs).
  const named = tenants.filter((t) => t.tenant !== "");
  $("tenants-table").hidden = named.length === 0;
  $("tenants").replaceChildren(...named.map((t) => {
    const row = el("tr", "");
    for (const cell of [t.tenant, t.weight ?? "–", t.running, t.waiting, percent(t.share)]) {
      row.append(el("td", "", String(cell)));
    }
    return row;
  }));
}

function show(stats) {
  const memory = showModels(stats);
  if (stats.running === undefined) { // the model shown is not loaded: its engine has nothing to show
    $("model").textContent = `${stats.model} (not loaded)${memory}`;
    return;
  }
  const tp = stats.tensor_parallel;
  const down = (tp.ranks || []).filter((r) => !r.up).map((r) => r.rank);
  const ranks = tp.size > 1
    ? ` · ${tp.size} tensor-parallel ranks (${down.length ? `rank ${down.join(", ")} down` : "all up"})`
    : "";
  $("model").textContent = `${stats.model} · context ${stats.max_model_len}${ranks} · up ${Math.round(stats.uptime_s)} s`
    + (stats.models.length > 1 ? memory : "");
  showTenants(stats.tenants || []);
  $("running").textContent = stats.running;
  $("running-sub").textContent = `of ${stats.max_num_seqs} at most`;
  $("waiting").textContent = stats.waiting;
  $("preemptions").textContent = `${stats.totals.preemptions} preemptions`;
  const kv = stats.kv;
  $("kv").textContent = percent(kv.usage);
  $("kv-bar").style.width = `${(100 * kv.usage).toFixed(1)}%`;
  $("kv-sub").textContent = kv.blocks_total !== undefined
    ? `${kv.blocks_used} / ${kv.blocks_total} blocks · ${kv.blocks_cached} cached`
    : `${kv.tokens_reserved} / ${kv.tokens_total} tokens`;
  const prefix = stats.prefix_cache;
  $("prefix").textContent = percent(prefix.hit_rate);
  $("prefix-sub").textContent = `${prefix.hit_tokens} of ${prefix.queried_tokens} prompt tokens`;
  const { generation_tokens: generated, prompt_tokens: prompt } = stats.throughput;
  $("generation-rate").textContent = mean(generated.slice(-RATE_WINDOW_S)).toFixed(1);
  $("generation-sub").textContent = `${stats.totals.generation_tokens} generated in all`;
  $("prompt-rate").textContent = mean(prompt.slice(-RATE_WINDOW_S)).toFixed(1);
  $("prompt-sub").textContent = `${stats.totals.prompt_tokens} prompt tokens of finished requests`;
  for (const [id, latency] of [["ttft", stats.latency.ttft_s], ["itl", stats.latency.itl_s]]) {
    $(id).textContent = seconds(latency.p50);
    $(`${id}-sub`).textContent = `p90 ${seconds(latency.p90)} · p99 ${seconds(latency.p99)} · last ${latency.count}`;
  }
  const spec = stats.speculative;
  $("spec-tile").hidden = !spec;
  if (spec) {
    $("spec").textContent = percent(spec.acceptance_rate);
    const length = spec.mean_accepted_length === null ? "–" : spec.mean_accepted_length.toFixed(2);
    $("spec-sub").textContent = `${spec.accepted_tokens} of ${spec.draft_tokens} tokens · ${length} a step`;
  }
  drawChart($("generation-chart"), generated, "generation");
  drawChart($("prompt-chart"), prompt, "prompt");
  $("sequences").replaceChildren(...stats.sequences.map((s) => {
    const row = el("tr");
    for (const cell of [s.id, s.state, s.prompt_tokens, s.cached_tokens, s.generated_tokens, s.blocks, s.age_s.toFixed(1)]) {
      row.append(el("td", "", String(cell)));
    }
    return row;
  }));
}

async function poll() {
  clearTimeout(timer);
  timer = null;
  if (polling) return;
  polling = true;
  try {
    const response = await api(shownModel === null ? "/stats" : `/stats?model=${encodeURIComponent(shownModel)}`);
    if (!response.ok) throw new Error(await errorText(response));
    show(await response.json());
    $("status").textContent = `live · ${new Date().toLocaleTimeString()}`;
    $("status").className = "status-ok";
  } catch (error) {
    $("status").textContent = error instanceof KeyNeeded ? "needs an API key" : `unreachable: ${error.message}`;
    $("status").className = "status-bad";
    if (error instanceof KeyNeeded) return; // asked again once a key is saved
  } finally {
    polling = false;
  }
  schedule();
}

function schedule() {
  if (timer === null && !document.hidden) timer = setTimeout(poll, PERIOD_MS);
}

setUpKeyDialog();
whenKeySaved(poll);
document.addEventListener("visibilitychange", () => {
  if (document.hidden && timer !== null) {
    clearTimeout(timer);
    timer = null;
  } else if (!document.hidden) {
    schedule();
  }
});
poll();
