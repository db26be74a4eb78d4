"""The HTTP API's routes, one router per resource, which `serve.app` includes: `page` (the page and its static
files), `health` (/health, /metrics), `songs` (a job: submit, list, read, delete, cancel, resume, render), `files`
(a song's audio, signed audio URL, peaks, score, score as MIDI and result.json), `takes` (a job's takes), `events`
(a job's Server-Sent Events), `length` (the longest song a body can reach; a capped song continued), `adapters`
(the registered adapters, OpenAI's model list), `scores` (an ABC score checked by the server's reader, or written
as MIDI) and `speech` (OpenAI's /v1/audio/speech). `common` holds what they share: who is trusted (the API key),
the JSON answer, the error handlers."""
