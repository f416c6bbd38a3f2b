// The status page: fetches /status.json every two seconds and redraws (uPlot draws the plots).
// Everything from the daemon is written with textContent: peer ids and versions come from
// the network.
"use strict";

const PERIOD_MS = 2000;
const plots = {};

function $(id) { return document.getElementById(id); }
function set(id, text) { $(id).textContent = text; }

function bytes(n) {
  if (n === null || n === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function duration(s) {
  if (s < 60) return s.toFixed(1) + "s";
  const m = Math.floor(s / 60);
  if (m < 60) return m + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  const h = Math.floor(m / 60);
  if (h < 48) return h + "h" + String(m % 60).padStart(2, "0") + "m";
  return Math.floor(h / 24) + "d" + String(h % 24).padStart(2, "0") + "h";
}

function num(v, digits) { return (v === null || v === undefined) ? "-" : Number(v).toFixed(digits); }

function row(tbody, cells, cls) {
  const tr = document.createElement("tr");
  if (cls) tr.className = cls;
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = c;
    tr.appendChild(td);
  }
  tbody.appendChild(tr);
}

function plot(id, series, data) {
  // data: [t, ...series values]; drawn once there are two samples
  const el = $(id);
  const points = data[0].length;
  el.dataset.points = String(points);
  const width = Math.max(320, el.clientWidth || 800);
  if (!plots[id]) {
    if (points < 2) return;
    plots[id] = new uPlot({
      width: width, height: 200,
      series: [{}].concat(series.map(([label, stroke]) => ({ label, stroke, width: 2, spanGaps: true }))),
      axes: [{}, { size: 90 }],
    }, data, el);
  } else {
    plots[id].setData(data);
  }
}

function render(d) {
  const st = d.status, comps = st.components || {};
  const server = comps.stage_server || null, trainer = comps.trainer || null;
  set("peer", st.peer_id);
  set("conn", "updated " + new Date(d.now_unix * 1000).toLocaleTimeString() + " (every 2 s)");
  set("run", st.run + "  (" + (st.n_stages === null ? "?" : st.n_stages) + " stages)  version " + st.version);
  set("stage", st.stage === null ? "none" : "stage " + st.stage);
  set("state", st.paused ? st.state + " (paused)" : st.state);
  set("roles", [st.server ? "server" : "", st.trainer ? "trainer" : ""].filter(Boolean).join("+") || "none");
  set("waiting", d.waiting_for || "nothing");
  $("waiting").className = d.waiting_for ? "warn" : "";
  if (server) {
    set("server", "stage " + server.stage + " (" + server.state + ")  " + (server.applied || 0) +
        " micro-batches served  " + num(server.throughput, 1) + " samples/s measured");
    set("step", String(server.epoch === undefined ? "-" : server.epoch) +
        "  (" + (server.replicas_seen || 1) + " replica(s) averaging)");
    set("queue", String(server.queue || 0));
  } else {
    set("server", "no stage server"); set("step", "-"); set("queue", "-");
  }
  if (trainer) {
    const mb = trainer.micro_batches || {};
    set("trainer", "loss " + num(trainer.loss_ewma, 3) + "  " + num(trainer.tokens_per_s, 0) +
        " tokens/s  " + (mb.completed || 0) + " micro-batches done, " + (mb.failed || 0) + " failed");
  } else {
    set("trainer", "no trainer");
  }
  set("traffic", "in " + bytes(st.bytes_in) + "   out " + bytes(st.bytes_out) +
      (st.upload_limit_mbps === null ? "" : "   upload limit " + st.upload_limit_mbps + " Mb/s"));
  const prog = server && server.state_download_progress;
  if (prog && prog.total_bytes > 0) {
    const pct = 100 * prog.done_bytes / prog.total_bytes;
    set("download", bytes(prog.done_bytes) + " of " + bytes(prog.total_bytes) + " (" + pct.toFixed(0) +
        "%) from " + prog.donors + " donor(s)" + (prog.eta_s === null || prog.eta_s === undefined ? "" : ", ETA " + duration(prog.eta_s)));
    $("download-bar").className = "bar";
    $("download-fill").style.width = pct.toFixed(1) + "%";
  } else if (server && server.state_wait) {
    const w = server.state_wait;
    set("download", "refused " + w.refusals + " of " + w.of + " times: " + w.reason + "; asking again");
    $("download-bar").className = "bar hidden";
  } else {
    const last = server && server.state_download;
    set("download", last ? "done: " + bytes(last.bytes) + " from " + last.donors + " donor(s) in " + last.seconds + "s" : "none");
    $("download-bar").className = "bar hidden";
  }

  const stages = document.querySelector("#stages tbody");
  stages.replaceChildren();
  for (const s of d.stages) {
    row(stages, [String(s.stage), s.online === 0 ? "0 (EMPTY)" : String(s.online), String(s.joining),
                 s.throughput.toFixed(1)], s.online === 0 ? "empty" : "");
  }
  const peers = document.querySelector("#peers tbody");
  peers.replaceChildren();
  for (const p of st.peers) {
    row(peers, ["…" + p.peer_id.slice(-8), p.stage === null ? "-" : String(p.stage), p.state,
                p.rtt_ms === null ? "-" : p.rtt_ms.toFixed(1) + " ms",
                p.min_rtt_ms === null ? "-" : p.min_rtt_ms.toFixed(1) + " ms", p.path || "-", p.nat || "-"]);
  }

  set("contrib-now", (server ? server.applied || 0 : 0) + " micro-batches served, " +
      (trainer ? trainer.tokens || 0 : 0) + " tokens trained, up " + duration(st.uptime_s));
  const life = st.lifetime;
  set("contrib-life", life ? life.micro_batches_served + " micro-batches served, " + life.tokens +
      " tokens trained, online " + duration(life.uptime_s) + ", " + bytes(life.bytes_out) + " sent, " +
      life.runs + " start(s) since " + new Date(life.since_unix * 1000).toLocaleDateString() : "-");

  const h = d.history;
  plot("loss-plot", [["training loss", "#c33"], ["validation loss", "#36c"]], [h.t, h.loss, h.val_loss]);
  plot("rate-plot", [["tokens/s (trainer)", "#393"], ["micro-batches/s served", "#939"], ["queue", "#999"]],
       [h.t, h.tokens_per_s, h.served_per_s, h.queue]);
  plot("traffic-plot", [["in", "#36c"], ["out", "#c63"]], [h.t, h.in_bps, h.out_bps]);
}

async function refresh() {
  try {
    const response = await fetch("/status.json", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (err) {
    set("conn", "cannot reach the daemon: " + err.message);
    $("conn").className = "warn";
  }
}

refresh();
setInterval(refresh, PERIOD_MS);
