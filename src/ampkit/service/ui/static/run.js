// ampkit web UI: the run page's live plots and the compare page's overlays (uPlot, vendored).
// Data comes from /ui/runs/{id}/data (same origin, the session cookie). Everything put in the page
// from that data goes through textContent: no HTML is built from strings.
"use strict";

(function () {
  const COLORS = ["#2457c5", "#c2185b", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#5d4037", "#455a64"];
  const SKIP = "#f0a500";
  const EVENT = "#c62828";
  const POLL_MS = 2000;
  const ROOT = document.body.dataset.root || "";  // where the service is mounted ("" at the top)
  const STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];  // whole steps
  // what tests and curious users can read: the charts, their data and the markers as drawn
  const state = (window.ampkit = { charts: {}, data: null, marks: {}, polls: 0 });

  function fmt(v) {
    if (v == null) return "–";
    const a = Math.abs(v);
    return a !== 0 && (a >= 1e6 || a < 1e-3) ? v.toExponential(4) : String(+v.toPrecision(6));
  }

  function width(el) {
    return Math.max(300, Math.floor(el.getBoundingClientRect().width || 600));
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (r.status === 401) { window.location.assign(ROOT + "/ui/signin"); throw new Error("signed out"); }
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  // Vertical dashed lines for events, ticks at the bottom for skipped steps; records what it drew.
  function markers(name) {
    return {
      hooks: {
        draw: [function (u) {
          const d = state.data;
          if (!d) return;
          const ctx = u.ctx, b = u.bbox, dpr = window.devicePixelRatio || 1;
          const drawn = [];
          ctx.save();
          ctx.fillStyle = SKIP;
          for (const s of d.skipped) {
            const x = u.valToPos(s, "x", true);
            if (x < b.left || x > b.left + b.width) continue;
            ctx.fillRect(x - dpr, b.top + b.height - 8 * dpr, 2 * dpr, 8 * dpr);
            drawn.push({ kind: "skipped", step: s, px: x / dpr });
          }
          ctx.strokeStyle = EVENT;
          ctx.fillStyle = EVENT;
          ctx.lineWidth = 1.5 * dpr;
          ctx.font = 11 * dpr + "px sans-serif";
          for (const e of d.events) {
            if (d.marked.indexOf(e.kind) < 0) continue;
            const x = u.valToPos(e.step, "x", true);
            if (x < b.left - 1 || x > b.left + b.width + 1) continue;
            ctx.setLineDash([4 * dpr, 3 * dpr]);
            ctx.beginPath();
            ctx.moveTo(x, b.top);
            ctx.lineTo(x, b.top + b.height);
            ctx.stroke();
            ctx.setLineDash([]);
            ctx.fillText(e.kind, x + 3 * dpr, b.top + 12 * dpr);
            drawn.push({ kind: e.kind, step: e.step, px: x / dpr });
          }
          ctx.restore();
          state.marks[name] = { drawn: drawn, left: b.left / dpr, right: (b.left + b.width) / dpr };
        }],
      },
    };
  }

  function chart(el, name, label, data, plugins, series) {
    const opts = {
      width: width(el), height: 240,
      scales: { x: { time: false } },
      axes: [{ label: "step", incrs: STEPS }, { size: 70, values: (u, vals) => vals.map(fmt) }],
      series: [{ label: "step", value: (u, v) => (v == null ? "–" : String(v)) }].concat(series || [
        { label: label, stroke: COLORS[0], width: 1.5, spanGaps: false, value: (u, v) => fmt(v),
          points: { show: data[0].length <= 200 } },
      ]),
      plugins: plugins || [],
    };
    const u = new uPlot(opts, data, el);
    state.charts[name] = u;
    return u;
  }

  function eventText(e) {
    const skip = { schema_version: 1, type: 1, kind: 1, step: 1, time: 1, run_id: 1, diagnosis: 1,
                   nonfinite_params: 1 };
    const parts = [];
    for (const k of Object.keys(e)) {
      if (skip[k]) continue;
      const v = e[k];
      parts.push(k + "=" + (typeof v === "object" ? JSON.stringify(v) : String(v)));
    }
    return parts.join(", ");
  }

  function showEvents(d) {
    const body = document.querySelector("#events tbody");
    if (!body || body.childElementCount === d.events.length) return;
    body.replaceChildren();
    for (const e of d.events) {
      const tr = document.createElement("tr");
      tr.className = "event " + (d.marked.indexOf(e.kind) >= 0 ? "marked" : "");
      tr.dataset.kind = String(e.kind);
      tr.dataset.step = String(e.step);
      for (const text of [String(e.step), String(e.kind), eventText(e)]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    const more = document.getElementById("events-more");
    if (more) {
      more.textContent = d.events_total > d.events.length
        ? `${d.events_total - d.events.length} more events are in the run's log.` : "";
    }
  }

  async function runPage(section) {
    const id = section.dataset.run;
    let wasLive = section.dataset.live === "true";
    async function tick() {
      let d;
      try {
        d = await getJSON(`${ROOT}/ui/runs/${encodeURIComponent(id)}/data`);
      } catch (err) {
        setTimeout(tick, POLL_MS * 2);
        return;
      }
      state.data = d;
      state.polls += 1;
      for (const name of Object.keys(d.series)) {
        const s = d.series[name];
        const el = document.getElementById("plot-" + name);
        if (!el) continue;
        const data = [s.x, s.y];
        if (state.charts[name]) state.charts[name].setData(data);
        else chart(el, name, s.title, data, [markers(name)]);
        el.dataset.points = String(s.x.length);
        el.querySelector("figcaption").textContent = s.title;
      }
      const steps = document.getElementById("run-steps");
      if (steps) {
        steps.textContent = `${d.steps} steps logged` +
          (d.skipped_total ? `, ${d.skipped_total} skipped` : "");
      }
      const status = document.getElementById("run-status");
      if (status) { status.textContent = d.status; status.className = "status " + d.status; }
      showEvents(d);
      if (d.live) setTimeout(tick, POLL_MS);
      else if (wasLive) { wasLive = false; window.location.reload(); }  // the summary and buttons of the end
    }
    await tick();
  }

  async function comparePage(section) {
    const ids = section.dataset.runs.split(",").filter(Boolean);
    const all = await Promise.all(ids.map((i) => getJSON(`${ROOT}/ui/runs/${encodeURIComponent(i)}/data`)));
    for (const fig of ["loss", "speed"]) {
      const el = document.getElementById("plot-compare-" + fig);
      if (!el) continue;
      const data = uPlot.join(all.map((d) => [d.series[fig].x, d.series[fig].y]));
      const series = ids.map((i, k) => ({
        label: i, stroke: COLORS[k % COLORS.length], width: 1.5, spanGaps: true, value: (u, v) => fmt(v),
      }));
      el.querySelector("figcaption").textContent = all[0].series[fig].title;
      chart(el, "compare-" + fig, fig, data, [], series);
      el.dataset.points = String(data[0].length);
    }
  }

  function resize() {
    for (const name of Object.keys(state.charts)) {
      const u = state.charts[name];
      u.setSize({ width: width(u.root.parentElement), height: 240 });
    }
  }

  window.addEventListener("resize", resize);
  document.addEventListener("DOMContentLoaded", function () {
    const run = document.getElementById("plots");
    if (run) runPage(run);
    const cmp = document.getElementById("compare-plots");
    if (cmp) comparePage(cmp);
  });
})();
