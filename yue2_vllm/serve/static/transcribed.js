// A transcription's record — what POST /v1/transcriptions answers as `transcription`, what a cover's request carries
// — shown where a musician looks (the melody source's panel, the cover's song view): where the score came from, its
// warnings a line each (the drift with its figures), its licence.

import { minutes } from "./length.js";

export function showTranscription(record, box, facts, warnings, licence) {
  box.hidden = false;
  const source = record.source || {};
  facts.textContent = `Transcribed by ${record.transcriber_version} from ${minutes(source.seconds || 0)} of ` +
    `${source.format || "audio"}: ${record.meter} · K:${record.key} · ♩ = ${record.bpm}` +
    (record.edited === undefined ? "" : record.edited ? " · the score edited since" : " · the score as transcribed");
  warnings.textContent = "";
  for (const warning of record.warnings) {
    const item = document.createElement("li");
    item.dataset.code = warning.code;
    item.textContent = warning.message;
    warnings.appendChild(item);
  }
  licence.hidden = !record.licence;
  licence.textContent = record.licence ? `Licence: ${record.licence}` : "";
}
