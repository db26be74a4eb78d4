// A song's live events: its SSE stream read over fetch (so the API key can be sent), reconnecting with backoff.

import { headers, parseJson } from "./api.js";

// The complete events in `text` (lines already ended by LF) as [kind, data text], and the unfinished rest.
function splitEvents(text) {
  const events = [];
  let end;
  while ((end = text.indexOf("\n\n")) >= 0) {
    const block = text.slice(0, end);
    text = text.slice(end + 2);
    let kind = "message", data = "";
    for (const line of block.split("\n")) {
      if (line.startsWith("event: ")) kind = line.slice(7);
      else if (line.startsWith("data: ")) data += (data ? "\n" : "") + line.slice(6);
    }
    if (data) events.push([kind, data]);
  }
  return { events, rest: text };
}

// Follow song `id`'s events until `signal` aborts, the song is gone (404, 401) or `onEvent` says it is done.
export async function follow(id, signal, onEvent) {
  let delay = 500;
  while (!signal.aborted) {
    try {
      const response = await fetch(`/v1/songs/${id}/events`, { headers: headers({ Accept: "text/event-stream" }), signal });
      if (response.status === 404 || response.status === 401) return;
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "", pendingCR = false;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        // A line ends at CRLF, LF or CR (the event-stream format); a CR at a chunk's end may start a CRLF.
        let text = (pendingCR ? "\r" : "") + decoder.decode(value, { stream: true });
        pendingCR = text.endsWith("\r");
        if (pendingCR) text = text.slice(0, -1);
        const { events, rest } = splitEvents(buffer + text.replace(/\r\n?/g, "\n"));
        buffer = rest;
        for (const [kind, data] of events) if (onEvent(kind, parseJson(data))) return;
        delay = 500;
      }
    } catch (error) {
      if (signal.aborted) return;
    }
    await new Promise((resolve) => setTimeout(resolve, delay));  // the server restarted? it resumes the job
    delay = Math.min(delay * 2, 8000);
  }
}
