// Nexus dashboard: reads /api/usage-stream (Server-Sent Events) and the
// history endpoint, and draws with plotly.js (shipped by the plotly Python
// package, served from this server: no CDN). No build step.
"use strict";

(function () {
  const RATE_WINDOW_S = 60; // rates are averaged over the last minute
  const LIVE_CHART_S = 300; // the live chart shows five minutes
  const HISTORY_REFRESH_MS = 10000; // about the rollup interval
  const PLOT_CONFIG = { displayModeBar: false, responsive: true };
  const ACCENT = "#2f6fde";
  const BAD = "#c7362f";

  const body = document.body;
  const streamUrl = body.dataset.streamUrl;
  const historyUrl = body.dataset.historyUrl;
  const fleetUrl = body.dataset.fleetUrl;
  const FLEET_REFRESH_MS = 2000;

  // Cluster totals per model over time, for each model's tokens per minute:
  // {t (s), byModel{}}. Counters only grow while servers run; a drop means a
  // restart, after which the window starts again.
  let samples = [];
  let latest = null;
  const history = { hour: null, day: null };

  function $(id) {
    return document.getElementById(id);
  }

  function format(n, digits) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    return n.toLocaleString(undefined, {
      maximumFractionDigits: digits === undefined ? 0 : digits,
      minimumFractionDigits: digits === undefined ? 0 : digits,
    });
  }

  function formatMs(ms) {
    if (ms === null || ms === undefined) return "–";
    return ms >= 1000 ? format(ms / 1000, 2) + " s" : format(ms, 0) + " ms";
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function fillTable(id, rows, emptyText, columns) {
    const tbody = $(id).querySelector("tbody");
    tbody.replaceChildren();
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = cell(emptyText);
      td.colSpan = columns;
      tr.append(td);
      tbody.append(tr);
      return;
    }
    for (const row of rows) tbody.append(row);
  }

  function totalsOf(event) {
    const totals = { requests: 0, errors: 0, tokens: 0, inFlight: 0, byModel: {} };
    for (const s of event.series) {
      totals.requests += s.requests;
      totals.errors += s.errors;
      totals.tokens += s.total_tokens;
      totals.inFlight += s.in_flight;
      const m = (totals.byModel[s.model] = totals.byModel[s.model] || {
        requests: 0,
        errors: 0,
        tokens: 0,
      });
      m.requests += s.requests;
      m.errors += s.errors;
      m.tokens += s.total_tokens;
    }
    return totals;
  }

  function addSample(totals, t) {
    const last = samples[samples.length - 1];
    if (last && totals.requests < last.requests) samples = [];
    samples.push({ t: t, requests: totals.requests, byModel: totals.byModel });
    while (samples.length > 2 && samples[1].t < t - RATE_WINDOW_S) samples.shift();
  }

  // Each model's tokens per minute over the window, up to `now`.
  function modelRates(now) {
    const byModel = {};
    if (samples.length === 0) return byModel;
    const first = samples[0];
    const last = samples[samples.length - 1];
    const span = Math.max(now - first.t, RATE_WINDOW_S);
    for (const model of Object.keys(last.byModel)) {
      const before = first.byModel[model] || { tokens: 0 };
      byModel[model] = ((last.byModel[model].tokens - before.tokens) / span) * 60;
    }
    return byModel;
  }

  function add(into, from) {
    into.requests += from.requests;
    into.errors += from.errors;
    into.tokens += from.tokens;
  }

  function zero() {
    return { requests: 0, errors: 0, tokens: 0 };
  }

  // Requests per minute from the rollups (the hour history), by minute start.
  function bucketMinutes() {
    const minutes = new Map();
    if (!history.hour) return minutes;
    for (const p of history.hour.points) {
      minutes.set(Date.parse(p.start) / 1000, {
        requests: p.requests,
        errors: p.errors,
        tokens: p.total_tokens,
      });
    }
    return minutes;
  }

  // The serving processes' own counts per time slot of the last minutes.
  function liveSlots() {
    const slots = new Map();
    if (!latest || !latest.recent) return slots;
    for (const s of latest.recent) {
      slots.set(s.start, { requests: s.requests, errors: s.errors, tokens: s.total_tokens });
    }
    return slots;
  }

  // Requests per slot over the last `seconds`, oldest first. The processes
  // count what they served since they started; the rollups count every
  // request, a little late. Each minute takes whichever counted more, so a
  // restart does not empty the chart and nothing is counted twice.
  function effectiveSlots(now, seconds) {
    const step = (latest && latest.slot_seconds) || 10;
    const live = liveSlots();
    const buckets = bucketMinutes();
    const liveByMinute = new Map();
    for (const [start, counts] of live) {
      const minute = Math.floor(start / 60) * 60;
      add((liveByMinute.get(minute) || liveByMinute.set(minute, zero()).get(minute)), counts);
    }
    const slots = [];
    const first = Math.floor((now - seconds) / step) * step + step;
    for (let t = first; t <= now; t += step) {
      const minute = Math.floor(t / 60) * 60;
      const counted = liveByMinute.get(minute) || zero();
      const rolled = buckets.get(minute);
      let counts = live.get(t) || zero();
      if (rolled && rolled.requests > counted.requests) {
        const share = step / 60; // spread the minute's count over its slots
        counts = {
          requests: rolled.requests * share,
          errors: rolled.errors * share,
          tokens: rolled.tokens * share,
        };
      }
      slots.push(Object.assign({ t: t, step: step }, counts));
    }
    return slots;
  }

  // Requests and tokens of the last 24 hours: the day's rollups, plus what
  // the processes counted in minutes the rollups have not caught up with.
  function dayTotals() {
    if (!history.day) return null;
    const totals = zero();
    for (const p of history.day.points) {
      add(totals, { requests: p.requests, errors: p.errors, tokens: p.total_tokens });
    }
    const buckets = bucketMinutes();
    const liveByMinute = new Map();
    for (const [start, counts] of liveSlots()) {
      const minute = Math.floor(start / 60) * 60;
      add((liveByMinute.get(minute) || liveByMinute.set(minute, zero()).get(minute)), counts);
    }
    for (const [minute, counted] of liveByMinute) {
      const rolled = buckets.get(minute) || zero();
      if (counted.requests > rolled.requests) {
        totals.requests += counted.requests - rolled.requests;
        totals.errors += counted.errors - rolled.errors;
        totals.tokens += counted.tokens - rolled.tokens;
      }
    }
    return totals;
  }

  function axis(title, extra) {
    return Object.assign(
      { title: { text: title, font: { size: 11 } }, tickfont: { size: 10 }, automargin: true },
      extra || {}
    );
  }

  function layout(xTitle, yTitle, from, to, extra) {
    return Object.assign(
      {
        margin: { l: 50, r: 10, t: 10, b: 40 },
        height: 180,
        showlegend: false,
        xaxis: axis(xTitle, { type: "date", range: [from, to], fixedrange: true }),
        yaxis: axis(yTitle, { rangemode: "tozero", fixedrange: true }),
        hovermode: "closest",
        bargap: 0.1,
      },
      extra || {}
    );
  }

  function drawLive(now) {
    const slots = effectiveSlots(now, LIVE_CHART_S);
    const x = slots.map((s) => new Date((s.t + s.step / 2) * 1000));
    const y = slots.map((s) => s.requests / s.step);
    const from = new Date((now - LIVE_CHART_S) * 1000);
    const to = new Date(now * 1000);
    Plotly.react(
      $("live-chart"),
      [
        {
          x: x,
          y: y,
          type: "scatter",
          mode: "lines",
          line: { color: ACCENT, width: 2, shape: "hvh" },
          fill: "tozeroy",
          fillcolor: "rgba(47, 111, 222, .12)",
          hovertemplate: "%{x|%H:%M:%S}: %{y:.2f} req/s<extra></extra>",
        },
      ],
      layout("time", "requests / s", from, to, { yaxis: axis("requests / s", { rangemode: "tozero", fixedrange: true, range: [0, Math.max(0.1, ...y) * 1.1] }) }),
      PLOT_CONFIG
    );
    $("live-chart-label").textContent = "peak " + format(Math.max(0, ...y), 2) + " req/s";
  }

  function drawHistory(range) {
    const h = history[range];
    const step = h.step_seconds;
    const x = h.points.map((p) => new Date(Date.parse(p.start) + (step * 1000) / 2));
    const custom = h.points.map((p) => [p.total_tokens, p.errors, p.latency_ms_avg === null ? "–" : formatMs(p.latency_ms_avg)]);
    const unit = range === "hour" ? "minute" : "15 min";
    const from = new Date(Date.parse(h.points[0].start));
    const to = new Date(Date.parse(h.points[h.points.length - 1].start) + step * 1000);
    Plotly.react(
      $("history-" + range),
      [
        {
          x: x,
          y: h.points.map((p) => p.requests),
          customdata: custom,
          type: "bar",
          name: "requests",
          marker: { color: ACCENT },
          hovertemplate:
            "%{x|%H:%M}<br>requests: %{y}<br>errors: %{customdata[1]}<br>" +
            "tokens: %{customdata[0]}<br>mean latency: %{customdata[2]}<extra></extra>",
        },
        {
          x: x,
          y: h.points.map((p) => p.errors),
          type: "bar",
          name: "errors",
          marker: { color: BAD },
          hovertemplate: "%{x|%H:%M}<br>errors: %{y}<extra></extra>",
        },
      ],
      layout("time", "requests / " + unit, from, to, { barmode: "overlay" }),
      PLOT_CONFIG
    );
    let requests = 0;
    let tokens = 0;
    let peak = 0;
    for (const p of h.points) {
      requests += p.requests;
      tokens += p.total_tokens;
      peak = Math.max(peak, p.requests);
    }
    $("history-" + range + "-label").textContent = requests
      ? "(peak " + format(peak) + " requests)"
      : "(no requests)";
    const top = Object.entries(h.tokens_by_model)
      .slice(0, 3)
      .map(([model, n]) => model + " " + format(n))
      .join(", ");
    $("history-" + range + "-summary").textContent =
      format(requests) + " requests, " + format(tokens) + " tokens" +
      (top ? " (top: " + top + ")" : "");
  }

  function render() {
    const now = Date.now() / 1000;
    drawLive(now);
    const day = dayTotals();
    if (day) {
      $("total-requests").textContent = format(day.requests);
      $("total-tokens").textContent = format(day.tokens);
    }
    if (!latest) return;
    const lastMinute = effectiveSlots(now, RATE_WINDOW_S);
    const last = zero();
    for (const s of lastMinute) add(last, s);
    $("request-rate").textContent = format(last.requests / RATE_WINDOW_S, 2);
    $("token-rate").textContent = format((last.tokens / RATE_WINDOW_S) * 60, 0);
    $("error-rate").textContent =
      last.requests > 0 ? format((last.errors / last.requests) * 100, 1) + " %" : "–";
    const totals = totalsOf(latest);
    $("in-flight").textContent = format(totals.inFlight);
    $("processes").textContent =
      latest.processes.length === 1
        ? "1 serving process"
        : latest.processes.length + " serving processes";

    const byModel = modelRates(now);
    const latency = {};
    for (const l of latest.latency) latency[l.model] = l;
    const modelRows = Object.keys(totals.byModel)
      .sort()
      .map(function (model) {
        const m = totals.byModel[model];
        const l = latency[model] || {};
        const tr = document.createElement("tr");
        tr.dataset.model = model;
        tr.append(
          cell(model),
          cell(format(byModel[model] || 0, 0), "num"),
          cell(formatMs(l.p50_ms), "num"),
          cell(formatMs(l.p95_ms), "num"),
          cell(format(m.requests), "num"),
          cell(format(m.errors), "num")
        );
        return tr;
      });
    fillTable("models", modelRows, "No traffic yet.", 6);

    const backendRows = latest.backends.map(function (b) {
      const tr = document.createElement("tr");
      tr.dataset.backend = b.name;
      const status = b.enabled ? b.status : "disabled";
      const health = cell(status, "status status-" + status);
      if (b.last_error) health.title = b.last_error;
      if (b.enabled && b.stale) {
        // The router counts an old result as unknown: no traffic until checked.
        health.className = "status status-unknown";
        const badge = document.createElement("span");
        badge.className = "stale";
        badge.textContent = "stale";
        badge.title =
          "Last health check over 3 health intervals ago: treated as unknown " +
          "(no traffic) until the next check. Is Celery beat running?";
        health.append(" ", badge);
      }
      tr.append(
        cell(b.name),
        health,
        cell(format(b.in_flight), "num"),
        cell(formatMs(b.avg_latency_ms), "num"),
        cell(
          b.prefix_cache_hit_rate == null
            ? "–"
            : Math.round(b.prefix_cache_hit_rate * 100) + " %",
          "num"
        ),
        cell(b.last_check_at ? new Date(b.last_check_at).toLocaleTimeString() : "never")
      );
      return tr;
    });
    fillTable("backends", backendRows, "No backends configured.", 6);
    renderAdmission(latest.admission);
  }

  // Admission control's codes, in the words of the README's error list.
  const REFUSALS = {
    queue_full: "queue full (503)",
    flow_queue_full: "flow's queue full (503)",
    queue_ttl_expired: "waited longer than queue_ttl (503)",
    preempted: "preempted (503)",
    deadline_exceeded: "client deadline passed (504)",
    client_closed: "client left while waiting (499)",
  };

  function countRows(counts, label) {
    return Object.keys(counts)
      .filter((name) => counts[name] > 0)
      .sort()
      .map(function (name) {
        const tr = document.createElement("tr");
        tr.dataset.reason = name;
        tr.append(cell(label(name)), cell(format(counts[name]), "num"));
        return tr;
      });
  }

  function bandCell(pool) {
    const td = cell("");
    const meter = document.createElement("meter");
    meter.min = 0;
    meter.max = Math.max(pool.bypass_limit, pool.stock, 1);
    meter.low = pool.lower;
    meter.high = pool.upper;
    meter.value = pool.stock;
    td.append(meter, " " + format(pool.lower, 1) + "–" + format(pool.upper, 1));
    td.title =
      "Straight through while fewer than " + pool.bypass_limit + " are in flight " +
      "and none wait; waiting requests are sent while fewer than " +
      pool.dispatch_limit + " are.";
    return td;
  }

  function renderAdmission(admission) {
    const state = $("admission-state");
    if (!admission) {
      state.textContent = "(no serving process reports it)";
      return;
    }
    state.textContent = admission.enabled
      ? "(" + format(admission.bypassed) + " straight through, " +
        format(admission.dispatched) + " sent after waiting)"
      : "(off)";
    const pools = admission.pools.map(function (pool) {
      const tr = document.createElement("tr");
      tr.dataset.backends = pool.backends.join(",");
      tr.append(
        cell(pool.backends.join(", ")),
        cell(pool.models.join(", ") || "–"),
        cell(format(pool.stock) + (pool.unit === "tokens" ? " tokens" : ""), "num stock"),
        bandCell(pool),
        cell(format(pool.waiting), "num waiting")
      );
      return tr;
    });
    fillTable("admission-pools", pools, "No admitted requests yet.", 5);
    const flows = [];
    for (const pool of admission.pools) {
      for (const flow of Object.keys(pool.flows).sort()) {
        if (!pool.flows[flow]) continue;
        const tr = document.createElement("tr");
        tr.dataset.flow = flow;
        tr.append(
          cell(flow),
          cell(pool.backends.join(", ")),
          cell(format(pool.flows[flow]), "num")
        );
        flows.push(tr);
      }
    }
    fillTable("admission-flows", flows, "Nothing waiting.", 3);
    fillTable(
      "admission-rejections",
      countRows(admission.rejections, (name) => REFUSALS[name] || name),
      "None.",
      2
    );
    fillTable(
      "admission-preemptions",
      countRows(admission.preemptions, (name) => name),
      "None.",
      2
    );
  }

  async function loadHistory(range) {
    try {
      const response = await fetch(historyUrl + "?range=" + range, {
        credentials: "same-origin",
      });
      if (!response.ok) throw new Error(response.status);
      history[range] = await response.json();
      drawHistory(range);
    } catch (error) {
      $("history-" + range + "-summary").textContent = "History unavailable.";
    }
  }

  async function loadFleet() {
    try {
      const response = await fetch(fleetUrl, { credentials: "same-origin" });
      if (!response.ok) throw new Error(response.status);
      const fleet = await response.json();
      $("fleet-summary").textContent =
        fleet.waiting + " waiting, " + fleet.held + " held, " +
        fleet.prewarm_total + " warm-ups, " + fleet.moved_total + " moved" +
        (fleet.enabled ? "" : " (strategy is not fleet: no lines)") +
        (fleet.paused || []).map(function (pause) {
          return "; cold loads paused on " + pause.backend + ": " + pause.reason;
        }).join("");
      fillTable("fleet-lines", fleet.lines.map(function (line) {
        const tr = document.createElement("tr");
        tr.append(cell(line.backend), cell(line.model), cell(String(line.waiting), "num"));
        return tr;
      }), "Nothing waiting.", 3);
      fillTable("fleet-warmups", fleet.prewarms.map(function (warm) {
        const tr = document.createElement("tr");
        tr.append(
          cell(warm.backend), cell(warm.model), cell(warm.outcome),
          cell(new Date(warm.at * 1000).toLocaleTimeString())
        );
        return tr;
      }), "No warm-ups yet.", 4);
    } catch (error) {
      $("fleet-summary").textContent = "Fleet state unavailable.";
    }
  }

  function onEvent(message) {
    latest = JSON.parse(message.data);
    // Client time, not the server's: the window is measured against Date.now().
    addSample(totalsOf(latest), Date.now() / 1000);
    render();
  }

  function connect() {
    const connection = $("connection");
    const source = new EventSource(streamUrl);
    source.addEventListener("snapshot", onEvent);
    source.addEventListener("update", onEvent);
    source.onopen = function () {
      connection.textContent = "live";
      connection.className = "pill pill-ok";
    };
    source.onerror = function () {
      // EventSource reconnects by itself; show that the numbers may be stale.
      connection.textContent = "reconnecting…";
      connection.className = "pill pill-bad";
    };
  }

  connect();
  // Rates are windowed over time: redraw even when no event arrives.
  setInterval(render, 1000);
  loadFleet();
  setInterval(loadFleet, FLEET_REFRESH_MS);
  for (const range of ["hour", "day"]) {
    loadHistory(range);
    setInterval(() => loadHistory(range), HISTORY_REFRESH_MS);
  }
})();
