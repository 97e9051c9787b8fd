// The KV page map: polls GET /debug/kv (with the admin key) and draws every worker's pool, page by page.
// Data shown here names tenants and quotes prompts: it only ever goes into the page as text (textContent),
// never as markup. The admin key stays in this tab's sessionStorage; `#key=...` in the URL is read once and
// removed from the address bar.
"use strict";

(() => {
  const POLL_MS = 500; // at most two snapshots a second, and none while the tab is hidden
  const STATES = ["free", "leased", "quarantined", "sealed", "receiving"];
  const [FREE, LEASED, QUARANTINED, SEALED, RECEIVING] = [0, 1, 2, 3, 4];
  const STATE_HELP = {
    free: "on the free list",
    leased: "leased to one request (tenant hue)",
    quarantined: "released; waits until nothing can touch it (I4)",
    sealed: "full and read-only (I9), shared by the requests of one tenant (prefix cache)",
    receiving: "PD transfer in flight into it",
  };
  const IDLE = "#b4bfd2"; // a sealed page no request holds: idle in the prefix cache, evictable
  const KEY_ITEM = "kvfence-admin-key";
  const $ = (id) => document.getElementById(id);
  const hues = new Map(); // tenant -> hue, in order of first sight: stable while the tab lives
  const workers = new Map(); // worker name -> {section, canvas, data}
  let key = takeKey();

  function takeKey() {
    const match = location.hash.match(/key=([^&]*)/);
    if (match) {
      sessionStorage.setItem(KEY_ITEM, decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY_ITEM);
  }

  // ---- DOM helpers (text only) ------------------------------------------------------------------------

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "dataset") Object.assign(node.dataset, v);
      else if (k === "style") Object.assign(node.style, v);
      else node[k] = v;
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }

  function fillBody(table, rows, columns) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows);
    if (!rows.length) body.append(el("tr", { className: "none" }, el("td", { colSpan: columns }, "none")));
  }

  function setStatus(text, error = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", error);
  }

  // ---- colours ----------------------------------------------------------------------------------------

  function hueOf(tenant) {
    if (!hues.has(tenant)) {
      let hue = (210 + hues.size * 137.508) % 360; // golden angle: neighbours stay far apart
      if (hue < 25 || hue > 335) hue = (hue + 50) % 360; // red is kept for integrity failures
      hues.set(tenant, Math.round(hue));
    }
    return hues.get(tenant);
  }

  function colour(state, tenant) {
    if (state === SEALED && tenant === null) return IDLE;
    if (state !== FREE && state !== QUARANTINED && tenant === null) return "#8a94a6"; // no live owner listed
    return shade(state, tenant === null ? 0 : hueOf(tenant));
  }

  function shade(state, hue) {
    if (state === FREE) return "#e3e6eb";
    if (state === QUARANTINED) return "#3b3f47";
    if (state === SEALED) return `hsl(${hue}, 70%, 30%)`;
    if (state === RECEIVING) return `hsl(${hue}, 70%, 75%)`;
    return `hsl(${hue}, 70%, 47%)`;
  }

  // ---- decoding ---------------------------------------------------------------------------------------

  function bytes(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  function decode(worker) {
    const p = worker.pages;
    return {
      state: bytes(p.state),
      request: new Int32Array(bytes(p.request).buffer),
      owner: new BigUint64Array(bytes(p.owner).buffer),
      tag: new BigUint64Array(bytes(p.tag).buffer),
      age: new Uint32Array(bytes(p.age_ms).buffer),
      holders: new Uint16Array(bytes(p.holders).buffer),
    };
  }

  const hex = (v) => (v === 0n ? "none" : "0x" + v.toString(16).padStart(16, "0"));
  const tenantAt = (w, page) => {
    const r = w.pages.request[page];
    return r >= 0 ? w.requests[r].tenant : null;
  };

  const clip = (text, n) => (text.length > n ? `${text.slice(0, n - 1)}…` : text);
  const shortId = (id) => (id.length > 22 ? `${id.slice(0, 13)}…${id.slice(-4)}` : id);

  function age(ms) {
    if (ms < 1000) return `${ms} ms`;
    if (ms < 120000) return `${(ms / 1000).toFixed(1)} s`;
    return `${Math.round(ms / 60000)} min`;
  }

  function ranges(pages) {
    const out = [];
    for (let i = 0; i < pages.length; ) {
      let j = i;
      while (j + 1 < pages.length && pages[j + 1] === pages[j] + 1) j++;
      out.push(i === j ? `${pages[i]}` : `${pages[i]}–${pages[j]}`);
      i = j + 1;
    }
    return out.join(", ");
  }

  // ---- one worker's grid ------------------------------------------------------------------------------

  function geometry(numPages, width) {
    const cell = numPages <= 512 ? 16 : numPages <= 2048 ? 11 : numPages <= 8192 ? 7 : 4;
    const cols = Math.max(1, Math.floor(width / cell));
    return { cell, cols, rows: Math.ceil(numPages / cols), gap: cell >= 7 ? 1 : 0 };
  }

  function workerView(w) {
    let view = workers.get(w.name);
    if (!view) {
      const canvas = el("canvas", { dataset: { worker: w.name } });
      canvas.addEventListener("mousemove", (e) => hover(view, e));
      canvas.addEventListener("mouseleave", () => ($("tooltip").hidden = true));
      const section = el("section", { className: "worker", dataset: { worker: w.name } });
      view = { section, canvas, data: null };
      workers.set(w.name, view);
    }
    return view;
  }

  function drawWorker(view, w, failedPages) {
    const n = w.num_pages;
    const width = Math.min(760, $("workers").clientWidth || 760);
    const g = geometry(n, width);
    const dpr = window.devicePixelRatio || 1;
    const canvas = view.canvas;
    canvas.style.width = `${g.cols * g.cell}px`;
    canvas.style.height = `${g.rows * g.cell}px`;
    canvas.width = g.cols * g.cell * dpr;
    canvas.height = g.rows * g.cell * dpr;
    Object.assign(canvas.dataset, { cell: g.cell, cols: g.cols, gap: g.gap, pages: n });
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const size = g.cell - g.gap;
    for (let p = 0; p < n; p++) {
      const x = (p % g.cols) * g.cell;
      const y = Math.floor(p / g.cols) * g.cell;
      const state = w.pages.state[p];
      ctx.fillStyle = colour(state, tenantAt(w, p));
      ctx.fillRect(x, y, size, size);
      if (state === RECEIVING && size >= 6) {
        ctx.strokeStyle = "#fff";
        ctx.beginPath();
        ctx.moveTo(x, y + size);
        ctx.lineTo(x + size, y);
        ctx.stroke();
      }
      if (failedPages.has(p)) {
        ctx.strokeStyle = "#d7263d";
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + 1, size - 2, size - 2);
        ctx.lineWidth = 1;
      }
    }
    view.geometry = g;
  }

  function workerHeader(w) {
    const c = w.counts;
    const verdict = w.preflight ? w.preflight.verdict : "no preflight";
    const level = !w.preflight ? "warn" : w.preflight.verdict === "ok" ? "" : w.preflight.can_start ? "warn" : "bad";
    return [
      el("h2", {}, w.name, el("span", { className: "role" }, w.role), el("span", { className: `verdict ${level}` }, `preflight ${verdict}`)),
      el(
        "p",
        { className: "counts" },
        `${w.num_pages} pages × ${w.page_size} tokens · ` +
          STATES.map((s, i) => `${s} ${c[s]}` + (i === SEALED && w.num_idle ? ` (${w.num_idle} idle)` : "")).join(" · "),
      ),
    ];
  }

  function hover(view, event) {
    const w = view.data;
    const g = view.geometry;
    if (!w || !g) return;
    const rect = view.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / g.cell);
    const page = Math.floor((event.clientY - rect.top) / g.cell) * g.cols + col;
    const tip = $("tooltip");
    if (col >= g.cols || page < 0 || page >= w.num_pages) {
      tip.hidden = true;
      return;
    }
    const r = w.pages.request[page];
    const request = r >= 0 ? w.requests[r] : null;
    const state = w.pages.state[page];
    const holders = w.pages.holders[page];
    const held =
      state === SEALED && holders === 0 ? ", idle in the prefix cache" : holders > 1 ? `, held by ${holders} requests` : "";
    tip.textContent = [
      `page ${page} · ${w.name}`,
      `state     ${STATES[state]}${held}, for ${age(w.pages.age[page])}`,
      `request   ${request ? `${request.id} (${request.phase})` : "none"}`,
      `tenant    ${request ? request.tenant : "none"}`,
      `lease id  ${hex(w.pages.owner[page])}`,
      `tag       ${hex(w.pages.tag[page])}  (last writer's lease)`,
    ].join("\n");
    tip.style.left = `${event.clientX + 14}px`;
    tip.style.top = `${event.clientY + 14}px`;
    tip.hidden = false;
  }

  // ---- panels -----------------------------------------------------------------------------------------

  function pagesByRequest(w) {
    const lists = w.requests.map(() => []);
    for (let p = 0; p < w.num_pages; p++) if (w.pages.request[p] >= 0) lists[w.pages.request[p]].push(p);
    return lists;
  }

  function requestRows(list) {
    const rows = [];
    for (const w of list) {
      const pages = pagesByRequest(w);
      w.requests.forEach((r, i) => {
        const tokens = `${r.prompt_tokens} + ${r.output_tokens}`;
        const swatch = el("span", { className: "swatch", style: { background: colour(LEASED, r.tenant) } });
        rows.push(
          el(
            "tr",
            { dataset: { request: r.id, tenant: r.tenant } },
            el("td", {}, w.name),
            el("td", { className: "mono", title: r.id }, shortId(r.id)),
            el("td", {}, swatch, " ", r.tenant),
            el("td", {}, r.phase),
            el("td", { className: "mono", title: ranges(pages[i]) }, `${pages[i].length}: ${clip(ranges(pages[i]) || "–", 24)}`),
            el("td", {}, tokens),
            el("td", { className: "preview", title: r.preview }, r.preview),
          ),
        );
      });
    }
    return rows;
  }

  function transferRows(list) {
    const rows = [];
    for (const w of list) {
      for (const t of w.transfers) {
        const bar = el("progress", { max: t.expected, value: t.received });
        rows.push(
          el(
            "tr",
            { dataset: { transfer: t.transfer_id } },
            el("td", {}, w.name),
            el("td", { className: "mono" }, t.transfer_id),
            el("td", { className: "mono", title: t.request_id }, shortId(t.request_id)),
            el("td", {}, bar, ` ${t.received} / ${t.expected}`),
          ),
        );
      }
    }
    return rows;
  }

  function receiverNote(list) {
    const notes = [];
    for (const w of list) {
      if (!w.receiver) continue;
      const dropped = Object.entries(w.receiver.dropped).map(([k, v]) => `${k} ${v}`);
      notes.push(`${w.name}: ${w.receiver.completed} transfers completed, ${w.receiver.applied} frames applied` +
        (dropped.length ? `, dropped: ${dropped.join(", ")}` : ", none dropped"));
    }
    return notes.join(" · ");
  }

  function failureCheck(f) {
    if (f.kind === "transfer") return `transfer: ${f.reason ?? "failed"}`;
    if (f.kind) return `I1 ${f.kind}`;
    return `${f.event ?? "failure"}${f.where ? ` (${f.where})` : ""}`; // e.g. a prefix-cache digest canary
  }

  function failureRows(list) {
    const all = [];
    for (const w of list) for (const f of w.integrity_failures) all.push([w, f]);
    all.sort((a, b) => b[1].time - a[1].time);
    return all.map(([w, f]) =>
      el(
        "tr",
        { dataset: { page: f.page ?? "", request: f.request_id ?? "" } },
        el("td", {}, new Date(f.time * 1000).toLocaleTimeString()),
        el("td", {}, w.name),
        el("td", { className: "mono", title: f.request_id ?? "" }, f.request_id ? shortId(f.request_id) : "–"),
        el("td", {}, f.tenant ?? "–"),
        el("td", { className: "mono" }, f.page ?? "–"),
        el("td", {}, failureCheck(f)),
        el("td", { className: "mono" }, f.expected_tag ?? f.expected_digest ?? "–"),
        el("td", { className: "mono" }, f.found_tag ?? f.found_digest ?? "–"),
      ),
    );
  }

  function preflightRows(list) {
    return list.map((w) => {
      const p = w.preflight;
      if (!p) return el("tr", {}, el("td", {}, w.name), el("td", { colSpan: 4 }, "not reported"));
      return el(
        "tr",
        { dataset: { worker: w.name, verdict: p.verdict }, title: p.reason },
        el("td", {}, w.name),
        el("td", {}, `${p.verdict}: ${p.reason}`),
        el("td", {}, `${p.context_length} (model ${p.model_context_length})`),
        el("td", {}, `${p.num_pages} × ${p.page_size}`),
        el("td", {}, p.num_full_context_requests),
      );
    });
  }

  function legend(list) {
    $("states").replaceChildren(
      ...STATES.map((s, i) => {
        const swatch = el("span", { className: "swatch", style: { background: shade(i, 210) } });
        return el("li", { title: STATE_HELP[s], dataset: { state: s } }, swatch, s);
      }),
      el("li", { title: STATE_HELP.sealed }, el("span", { className: "swatch", style: { background: IDLE } }), "sealed, idle"),
      el("li", { title: "an integrity check failed on this page" }, el("span", { className: "swatch failed" }), "integrity failure"),
    );
    const pages = new Map();
    for (const w of list) {
      for (let p = 0; p < w.num_pages; p++) {
        const t = tenantAt(w, p);
        if (t !== null && w.pages.state[p] !== FREE) pages.set(t, (pages.get(t) || 0) + 1);
      }
    }
    const tenants = [...pages.keys()].sort();
    tenants.forEach(hueOf);
    $("tenants").replaceChildren(
      ...tenants.map((t) => {
        const swatch = el("span", { className: "swatch", style: { background: colour(LEASED, t) } });
        return el("li", { dataset: { tenant: t, pages: pages.get(t) } }, swatch, `${t} · ${pages.get(t)} pages`);
      }),
    );
  }

  // ---- the loop ---------------------------------------------------------------------------------------

  function render(snapshot, roundTripMs) {
    const list = snapshot.workers.map((w) => ({ ...w, pages: decode(w) }));
    legend(list); // assigns hues in a stable order before anything is drawn
    const seen = new Set();
    for (const w of list) {
      const view = workerView(w);
      view.data = w;
      seen.add(w.name);
      const failed = new Set(w.integrity_failures.filter((f) => f.page !== null && f.page !== undefined).map((f) => f.page));
      view.section.replaceChildren(...workerHeader(w), view.canvas);
      drawWorker(view, w, failed);
    }
    for (const [name, view] of workers) if (!seen.has(name)) workers.delete(name);
    $("workers").replaceChildren(...list.map((w) => workers.get(w.name).section));
    fillBody($("requests"), requestRows(list), 7);
    fillBody($("transfers"), transferRows(list), 4);
    $("receiver-stats").textContent = receiverNote(list);
    fillBody($("failures"), failureRows(list), 8);
    fillBody($("preflight"), preflightRows(list), 5);
    const cost = list.map((w) => `${w.snapshot_ms} ms`).join(" + ");
    const problems = snapshot.errors.length ? ` · ${snapshot.errors.join("; ")}` : "";
    setStatus(
      `${snapshot.mode} · ${list.length} worker(s) · updated ${new Date(snapshot.time * 1000).toLocaleTimeString()}` +
        ` · snapshot ${cost}, round trip ${roundTripMs.toFixed(0)} ms${problems}`,
      snapshot.errors.length > 0,
    );
    document.body.dataset.updated = String(snapshot.time);
  }

  function askForKey(message) {
    $("key-form").hidden = false;
    $("key-message").textContent = message;
    setStatus("the page map needs the admin key (kvfence serve --admin-key)", true);
  }

  let generation = 0; // one polling loop at a time: a new key starts a new loop and ends the old one

  function start() {
    generation += 1;
    poll(generation);
  }

  async function poll(loop) {
    if (loop !== generation) return;
    if (!key) return askForKey("");
    if (!document.hidden) {
      const t0 = performance.now();
      try {
        const response = await fetch("debug/kv", { headers: { Authorization: `Bearer ${key}` }, cache: "no-store" });
        if (loop !== generation) return;
        if (response.status === 401 || response.status === 403) {
          key = null;
          sessionStorage.removeItem(KEY_ITEM);
          const forbidden = response.status === 403; // a tenant's key or the scrape key: known, not the admin key
          return askForKey(forbidden ? "that key does not open the page map: it needs the admin key" : "that key was refused");
        }
        if (!response.ok) throw new Error(`GET /debug/kv: HTTP ${response.status}`);
        render(await response.json(), performance.now() - t0);
      } catch (error) {
        setStatus(`${error.message}; retrying`, true);
      }
    }
    setTimeout(() => poll(loop), POLL_MS);
  }

  function useKey(value) {
    key = value;
    $("key-form").hidden = true;
    $("key-message").textContent = "";
    start();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("key-input").value);
    useKey($("key-input").value);
  });
  window.addEventListener("hashchange", () => {
    const value = takeKey();
    if (value && value !== key) useKey(value);
  });
  start();
})();
