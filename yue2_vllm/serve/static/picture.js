// A song's picture: the server's peaks answer (GET …/peaks, computed once from its FLAC) decoded and drawn.

import { api } from "./api.js";

// The answer: per channel (min, max) int8 pairs, and a log-frequency spectrogram as uint8 levels, column after
// column, lowest band first.
function bytesOf(base64) {
  const text = atob(base64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

function heat(v) {  // dark blue → purple → orange → pale yellow
  const stops = [[12, 10, 40], [90, 30, 130], [200, 60, 90], [250, 160, 50], [252, 250, 190]];
  const at = v * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(at)), t = at - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * t));
}

function pictureFrom(answer) {
  const lanes = answer.peaks.slice(0, 2).map((lane) => {
    const pairs = new Int8Array(bytesOf(lane).buffer);
    return Float32Array.from(pairs, (v) => v / 127);
  });
  const levels = bytesOf(answer.spectrogram);
  const { columns, rows } = answer;
  const image = new ImageData(columns, rows);
  for (let x = 0; x < columns; x++) {
    for (let r = 0; r < rows; r++) {
      const [red, green, blue] = heat(levels[x * rows + r] / 255);
      const at = ((rows - 1 - r) * columns + x) * 4;
      image.data[at] = red; image.data[at + 1] = green; image.data[at + 2] = blue; image.data[at + 3] = 255;
    }
  }
  return { lanes, buckets: answer.buckets, spectrogram: image, duration: answer.duration };
}

// A song's picture (pictureFrom), or null when `stillShown()` says the view moved on to another song meanwhile,
// so a late answer never lands under it.
export async function fetchPicture(doc, stillShown) {
  const answer = await api(`${doc.urls.self}/peaks`);
  return stillShown() ? pictureFrom(answer) : null;
}

// A picture (pictureFrom) into two canvases: both channels' peaks per pixel, and the spectrogram.
export function drawPictureInto(picture, wave, spectrum) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(1, Math.round(wave.clientWidth * ratio)), height = Math.round(wave.clientHeight * ratio);
  wave.width = width;
  wave.height = height;
  const context = wave.getContext("2d");
  const style = getComputedStyle(document.documentElement);
  context.clearRect(0, 0, width, height);
  const lane = height / 2;
  picture.lanes.forEach((peaks, c) => {
    const middle = lane * c + lane / 2, scale = lane / 2 - 2 * ratio;
    context.fillStyle = style.getPropertyValue("--line");
    context.fillRect(0, Math.round(middle), width, Math.max(1, Math.round(ratio / 2)));
    context.fillStyle = style.getPropertyValue("--accent");
    for (let x = 0; x < width; x++) {  // this pixel's extremes: over every bucket it covers
      const first = Math.floor(x * picture.buckets / width);
      const last = Math.max(first + 1, Math.floor((x + 1) * picture.buckets / width));
      let low = 0, high = 0;
      for (let b = first; b < last; b++) {
        if (peaks[2 * b] < low) low = peaks[2 * b];
        if (peaks[2 * b + 1] > high) high = peaks[2 * b + 1];
      }
      const top = middle - high * scale, bottom = middle - low * scale;
      context.fillRect(x, top, 1, Math.max(1, bottom - top));
    }
  });
  if (picture.spectrogram) {
    spectrum.hidden = false;
    spectrum.width = picture.spectrogram.width;
    spectrum.height = picture.spectrogram.height;
    spectrum.getContext("2d").putImageData(picture.spectrogram, 0, 0);
  } else if (spectrum) spectrum.hidden = true;
}
