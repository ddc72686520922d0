// ddspec chat page: streams answers from /v1/chat/completions and draws each step's draft tree.
// No build step and nothing fetched from elsewhere: plain DOM and SVG.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const state = { history: [], controller: null, trees: [], model: null, auth: false };

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => { box.hidden = true; }, 8000);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function loadHealth() {
  try {
    const r = await fetch("/health");
    const h = await r.json();
    state.model = h.model;
    state.auth = h.auth;
    $("model").textContent = `${h.model} · context ${h.context_window} · prefix reuse ${h.prefix_reuse ? "on" : "off"}`;
    $("key-label").hidden = !h.auth;
    const select = $("method");
    select.innerHTML = "";
    const methods = h.methods.includes(h.method) ? h.methods : [h.method, ...h.methods];  // e.g. eagle2@d3k2n3
    for (const m of methods) {
      const o = document.createElement("option");
      o.value = o.textContent = m;
      if (m === h.method) o.selected = true;
      select.appendChild(o);
    }
    document.body.dataset.ready = "1";
  } catch (e) {
    $("model").textContent = "server unreachable";
    showError("cannot reach the server: " + e);
  }
}

// -- transcript ---------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  div.appendChild(body);
  $("transcript").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    div.appendChild(meta);
  }
  meta.textContent = text;
}

// -- stats --------------------------------------------------------------------------------
function resetStats() {
  for (const id of ["rate", "tau", "tokens", "steps", "reused", "prefill"]) $("stat-" + id).textContent = "–";
}

function showLive(run) {
  const seconds = (performance.now() - run.start) / 1000;
  $("stat-rate").textContent = seconds > 0 ? (run.tokens / seconds).toFixed(1) : "–";
  $("stat-tokens").textContent = run.tokens;
  $("stat-steps").textContent = run.steps;
  $("stat-tau").textContent = run.steps ? (run.emitted / run.steps).toFixed(2) : "–";
}

function showUsage(usage) {
  const d = usage.ddspec || {};
  $("stat-rate").textContent = d.tokens_per_s !== undefined ? d.tokens_per_s.toFixed(1) : "–";
  $("stat-tau").textContent = d.steps ? d.tau.toFixed(2) : "–";
  $("stat-tokens").textContent = usage.completion_tokens;
  $("stat-steps").textContent = d.steps;
  $("stat-reused").textContent = `${d.reused_prompt_tokens} / ${usage.prompt_tokens}`;
  $("stat-prefill").textContent = `${Math.round(d.prefill_ms)} ms`;
}

// -- the draft tree -----------------------------------------------------------------------
function visible(text) {
  if (text === "") return "∅";
  const shown = text.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  return shown.length > 12 ? shown.slice(0, 11) + "…" : shown;
}

function layout(tree) {
  const n = tree.tokens.length;
  const children = Array.from({ length: n }, () => []);
  for (let i = 1; i < n; i++) children[tree.parents[i]].push(i);
  for (const c of children) c.sort((a, b) => tree.scores[b] - tree.scores[a]);
  const depth = new Array(n).fill(0), y = new Array(n).fill(0);
  let row = 0;
  const visit = (i) => {  // leaves take rows in order; a parent sits between its first and last child
    if (!children[i].length) { y[i] = row++; return; }
    for (const c of children[i]) { depth[c] = depth[i] + 1; visit(c); }
    y[i] = (y[children[i][0]] + y[children[i][children[i].length - 1]]) / 2;
  };
  visit(0);
  return { children, depth, y, rows: row };
}

function drawTree(entry) {
  const svg = $("tree");
  svg.innerHTML = "";
  if (!entry) return;
  const { tree, step } = entry;
  const nodes = tree.tokens.map((t, i) => ({ i, text: visible(tree.texts[i]), parent: tree.parents[i] }));
  const onPath = new Set(tree.path);
  if (tree.bonus_text !== undefined) {  // the target's own next token, shown after the accepted path
    nodes.push({ i: nodes.length, text: visible(tree.bonus_text), parent: tree.path[tree.path.length - 1], bonus: true });
  }
  const parents = nodes.map((n) => n.parent);
  const scores = nodes.map((n) => (n.bonus ? 1 : tree.scores[n.i]));
  const { depth, y, rows } = layout({ tokens: nodes, parents, scores });
  const width = (n) => Math.max(26, Math.min(110, 8 + 7.3 * [...n.text].length));
  const colW = Math.max(...nodes.map(width)) + 26, rowH = 24, pad = 10, top = 22;
  const maxDepth = Math.max(...depth);
  svg.setAttribute("width", pad * 2 + (maxDepth + 1) * colW);
  svg.setAttribute("height", top + pad + Math.max(rows, 1) * rowH);
  const X = (i) => pad + depth[i] * colW, Y = (i) => top + y[i] * rowH + rowH / 2;
  for (let d = 0; d <= maxDepth; d++) {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("class", "depth-label");
    t.setAttribute("x", pad + d * colW);
    t.setAttribute("y", 10);
    t.textContent = d === 0 ? "root" : "depth " + d;
    svg.appendChild(t);
  }
  for (const n of nodes) {
    if (n.parent < 0) continue;
    const p = n.parent, path = document.createElementNS(SVG, "path");
    const x1 = X(p) + width(nodes[p]), y1 = Y(p), x2 = X(n.i), y2 = Y(n.i), mx = (x1 + x2) / 2;
    path.setAttribute("d", `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`);
    const accepted = n.bonus || (onPath.has(n.i) && onPath.has(p));
    path.setAttribute("class", "edge" + (accepted ? " accepted" : ""));
    svg.appendChild(path);
  }
  for (const n of nodes) {
    const g = document.createElementNS(SVG, "g");
    const kind = n.i === 0 ? "root" : n.bonus ? "bonus" : onPath.has(n.i) ? "accepted" : "rejected";
    g.setAttribute("class", "node " + kind);
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", X(n.i));
    rect.setAttribute("y", Y(n.i) - 9);
    rect.setAttribute("width", width(n));
    rect.setAttribute("height", 18);
    rect.setAttribute("rx", 4);
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", X(n.i) + 4);
    text.setAttribute("y", Y(n.i) + 1);
    text.textContent = n.text;
    const title = document.createElementNS(SVG, "title");
    title.textContent = n.bonus ? `bonus token ${JSON.stringify(tree.bonus_text)}`
      : `${JSON.stringify(tree.texts[n.i])} (id ${tree.tokens[n.i]}), depth ${depth[n.i]}, score ${tree.scores[n.i]}`;
    g.append(rect, text, title);
    svg.appendChild(g);
  }
  $("tree-caption").textContent = `step ${entry.index + 1}: depth ${step.depth}, ${step.tree_size} nodes, ` +
    `${step.accepted} accepted + 1 bonus · draft ${step.draft_ms.toFixed(1)} ms, verify ${step.verify_ms.toFixed(1)} ms`;
}

function addTree(tree, step) {
  const entry = { tree, step, index: state.trees.length };
  state.trees.push(entry);
  const slider = $("step-slider");
  slider.max = state.trees.length - 1;
  slider.disabled = false;
  if ($("follow").checked) {
    slider.value = entry.index;
    drawTree(entry);
  }
}

// -- one request --------------------------------------------------------------------------
async function send(text) {
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.classList.add("streaming");
  const body = bubble.querySelector(".body");
  state.trees = [];
  resetStats();
  const run = { start: performance.now(), tokens: 0, steps: 0, emitted: 0 };
  const controller = state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "", usage = null, finish = null;
  try {
    const request = {
      messages: state.history, stream: true, stream_options: { include_usage: true },
      max_tokens: parseInt($("max-tokens").value, 10) || 256,
      temperature: parseFloat($("temperature").value) || 0,
      ddspec: { method: $("method").value, trace: true },
    };
    if (state.model) request.model = state.model;
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal,
    });
    if (!r.ok) {
      let message = `HTTP ${r.status}`;
      try { message += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        if (obj.usage) { usage = obj.usage; continue; }
        const choice = obj.choices[0];
        const piece = choice.delta.content;
        if (piece) { answer += piece; body.textContent = answer; }
        if (choice.finish_reason) finish = choice.finish_reason;
        const extra = obj.ddspec;
        if (extra && extra.step) {
          run.steps += 1;
          run.emitted += extra.step.accepted + 1;
        }
        if (extra && extra.tree) addTree(extra.tree, extra.step);
        if (extra) run.tokens += extra.new_tokens;
        showLive(run);
        bubble.scrollIntoView({ block: "end" });
      }
    }
    if (usage) {
      showUsage(usage);
      const d = usage.ddspec;
      setMeta(bubble, `${usage.completion_tokens} tokens · ${d.tokens_per_s.toFixed(1)} tokens/s · τ ${d.tau.toFixed(2)} · ` +
        `${d.method} · ${finish || ""}`);
    }
  } catch (e) {
    if (e.name === "AbortError") {
      setMeta(bubble, "stopped");
    } else {
      setMeta(bubble, "error: " + e.message);
      showError(e.message);
    }
  } finally {
    bubble.classList.remove("streaming");
    state.history.push({ role: "assistant", content: answer });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    document.body.dataset.done = String(Number(document.body.dataset.done || 0) + 1);
  }
}

// -- wiring -------------------------------------------------------------------------------
$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.trees = [];
  $("transcript").innerHTML = "";
  drawTree(null);
  $("tree-caption").textContent = "(no step yet)";
  resetStats();
});
$("step-slider").addEventListener("input", (ev) => {
  $("follow").checked = false;
  drawTree(state.trees[Number(ev.target.value)]);
});
loadHealth();
