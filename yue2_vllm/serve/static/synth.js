// A plain synth for a score's music (the server's reader's notes): WebAudio oscillators, one a note, scheduled a
// little ahead of the audio clock. No samples and no soundfont: nothing is fetched.

const TIMBRE = {  // a part's oscillator and its level
  Vocal: { type: "triangle", level: 0.30 },
  Ins: { type: "square", level: 0.07 },
  Chords: { type: "sine", level: 0.06 },
};
const AHEAD = 0.3;  // seconds of notes scheduled before the clock reaches them
const TICK_MS = 60;
const LEAD_IN = 0.08;  // seconds between Play and the first note

// The synth's state, readable from the console (and the page test): its AudioContext, the run playing, and how
// many notes each part has started since the page loaded.
export const synth = { context: null, run: null, started: { Vocal: 0, Ins: 0, Chords: 0 } };

export function hertz(pitch) {
  return 440 * 2 ** ((pitch - 69) / 12);
}

// The music's notes as sounds in seconds from its start: each voice's notes, then each chord's tones.
export function soundsOf(music) {
  const seconds = 60 / music.bpm;
  const sounds = [];
  for (const [part, notes] of Object.entries(music.voices)) {
    for (const note of notes) sounds.push({ part, pitch: note.pitch, at: note.onset * seconds,
                                            length: note.duration * seconds });
  }
  for (const chord of music.chords) {
    for (const pitch of chord.pitches) sounds.push({ part: "Chords", pitch, at: chord.onset * seconds,
                                                     length: chord.duration * seconds });
  }
  return sounds.sort((a, b) => a.at - b.at);
}

function sound(run, item) {
  const context = run.context;
  const { type, level } = TIMBRE[item.part];
  const start = run.start + item.at;
  const end = start + Math.max(item.length, 0.02);
  const oscillator = context.createOscillator();
  const envelope = context.createGain();
  oscillator.type = type;
  oscillator.frequency.value = hertz(item.pitch);
  envelope.gain.setValueAtTime(0, start);
  envelope.gain.linearRampToValueAtTime(level, start + 0.012);
  envelope.gain.setTargetAtTime(level * 0.6, start + 0.012, 0.12);  // decay to a sustain
  envelope.gain.setTargetAtTime(0, Math.max(end - 0.01, start + 0.015), 0.03);  // release
  oscillator.connect(envelope).connect(run.output);
  oscillator.start(start);
  oscillator.stop(end + 0.2);
  run.voices.add(oscillator);
  oscillator.onended = () => { run.voices.delete(oscillator); envelope.disconnect(); };
  synth.started[item.part] += 1;
}

// Play `music` (a ScoreMusic answer of POST /v1/scores/check) from its start; `onTime(seconds)` as it goes,
// `onEnd()` once it is over or stopped. Stops whatever played before.
export function play(music, { onTime = () => {}, onEnd = () => {} } = {}) {
  stop();
  const context = synth.context || (synth.context = new AudioContext());
  context.resume();
  const output = context.createGain();
  output.gain.value = 0.8;
  output.connect(context.destination);
  const run = { context, output, sounds: soundsOf(music), next: 0, voices: new Set(), timer: null, onEnd,
                start: context.currentTime + LEAD_IN, length: music.seconds };
  const pump = () => {
    const until = context.currentTime + AHEAD;
    while (run.next < run.sounds.length && run.start + run.sounds[run.next].at < until) {
      sound(run, run.sounds[run.next]);
      run.next += 1;
    }
    const played = Math.max(0, context.currentTime - run.start);
    onTime(Math.min(played, run.length));
    if (played >= run.length + 0.25) stop();
  };
  synth.run = run;
  pump();
  run.timer = setInterval(pump, TICK_MS);
  return run;
}

export function stop() {
  const run = synth.run;
  if (!run) return;
  synth.run = null;
  clearInterval(run.timer);
  const now = run.context.currentTime;
  run.output.gain.setTargetAtTime(0, now, 0.02);
  for (const oscillator of run.voices) oscillator.stop(now + 0.1);
  setTimeout(() => run.output.disconnect(), 300);
  run.onEnd();
}

export function playing() {
  return synth.run !== null;
}
