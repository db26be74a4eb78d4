// The adapters this server serves (GET /v1/adapters): one row each, a box to use it and its scale; the form sends
// the checked ones as `adapters: [{name, scale}]`.

import { $, api } from "./api.js";

export async function loadAdapters() {
  let listing;
  try {
    listing = (await api("/v1/adapters")).adapters;
  } catch {
    return;  // e.g. the key is not entered yet: the box stays hidden
  }
  const list = $("adapters-list");
  list.replaceChildren();
  for (const adapter of listing) {
    const row = document.createElement("div");
    row.className = "adapter";
    const use = Object.assign(document.createElement("input"), { type: "checkbox", id: `adapter-${adapter.name}` });
    use.dataset.adapter = adapter.name;
    const label = Object.assign(document.createElement("label"), { htmlFor: use.id });
    label.textContent = `${adapter.name} (${adapter.half.toUpperCase()}, rank ${adapter.rank}`
      + (adapter.licence ? `, ${adapter.licence})` : ")");
    const scale = Object.assign(document.createElement("input"), {
      type: "number", min: "-10", max: "10", step: "0.05", value: "1", id: `adapter-scale-${adapter.name}`,
      title: `${adapter.name}'s scale`,
    });
    scale.dataset.scaleOf = adapter.name;
    scale.setAttribute("aria-label", `${adapter.name} scale`);
    row.append(use, label, scale);
    list.append(row);
  }
  $("adapters-box").hidden = listing.length === 0;
}

export function chosenAdapters() {
  const chosen = [];
  for (const use of document.querySelectorAll("[data-adapter]")) {
    if (!use.checked) continue;
    const scale = document.querySelector(`[data-scale-of="${CSS.escape(use.dataset.adapter)}"]`).value.trim();
    chosen.push({ name: use.dataset.adapter, scale: scale === "" ? 1 : Number(scale) });
  }
  return chosen;
}
