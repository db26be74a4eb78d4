// The recent songs list (open, cancel, delete) and the server's health line.

import { $, FINAL, api, auth, describeError, needKey, show } from "./api.js";
import { act, select, view } from "./song.js";

let listed = "";  // the list as last drawn (redrawn only when it changed, so keyboard focus stays put)

export function forgetListed() {  // the next refreshJobs() draws the list even if it did not change
  listed = "";
}

function button(text, label, onClick) {
  const element = document.createElement("button");
  element.type = "button";
  element.className = "secondary small";
  element.textContent = text;
  element.setAttribute("aria-label", label);
  element.addEventListener("click", onClick);
  return element;
}

function songRow(song) {
  const row = document.createElement("tr");
  row.dataset.id = song.id;
  if (view.current && view.current.id === song.id) row.classList.add("selected");
  const created = new Date(song.created);
  row.innerHTML = `<td></td><td class="style"></td><td><span class="badge"></span></td><td></td>
    <td class="actions-cell"><button type="button" class="secondary small" data-open>Open</button></td>`;
  const cells = row.querySelectorAll("td");
  cells[0].textContent = created.toLocaleTimeString();
  cells[0].title = created.toLocaleString();
  cells[1].textContent = song.label ? `${song.label}: ${song.style}` : song.style;
  cells[1].title = song.error || song.style;
  const badge = cells[2].querySelector(".badge");
  badge.textContent = song.status;
  badge.classList.add(FINAL.has(song.status) ? song.status : song.status === "queued" ? "queued" : "running");
  cells[3].textContent = song.audio_seconds ? `${song.audio_seconds.toFixed(1)} s` : "";
  row.querySelector("[data-open]").setAttribute("aria-label", `Open song ${song.id}`);
  row.querySelector("[data-open]").addEventListener("click", () => select(song.id));
  if (!FINAL.has(song.status)) {
    cells[4].appendChild(button("Cancel", `Cancel song ${song.id}`, () => act(song.id, "cancel")));
  }
  cells[4].appendChild(button("Delete", `Delete song ${song.id}`, () => act(song.id, "delete")));
  return row;
}

export async function refreshJobs() {
  if (needKey()) return;
  try {
    const page = await api("/v1/songs?limit=20");
    show($("jobs-error"), "");
    const drawn = JSON.stringify(page.songs);
    if (drawn === listed) return;
    listed = drawn;
    const rows = $("jobs");
    const focused = document.activeElement && rows.contains(document.activeElement)
      ? document.activeElement.getAttribute("aria-label") : null;
    rows.textContent = "";
    for (const song of page.songs) rows.appendChild(songRow(song));
    $("jobs-empty").hidden = page.songs.length > 0;
    const again = focused && [...rows.querySelectorAll("button")].find((b) => b.getAttribute("aria-label") === focused);
    if (again) again.focus();
  } catch (error) {
    show($("jobs-error"), describeError(error));
  }
}

export async function refreshHealth() {
  const element = $("health");
  try {
    const response = await fetch("/health");
    const health = await response.json();
    auth.required = Boolean(health.api_key_required);
    const engine = health.engine;
    const what = engine.backend === "vllm" ? `vLLM engine ${engine.state}` : "torch backend";
    const replicas = health.replicas ? ` · replicas ${health.replicas}` : "";
    element.textContent = `${what}${replicas} · ${health.in_flight} in flight · queue ${health.queue.depth}/${health.queue.limit}`;
    element.className = "health " + (response.ok ? "ok" : "down");
  } catch (error) {
    element.textContent = "the server does not answer";
    element.className = "health down";
  }
}
