// A score's notation, drawn as SVG by abcjs (vendored: static/vendor/abcjs-basic-min.js, MIT, its licence beside
// it), loaded from this server the first time a score is drawn. abcjs reads the ABC text itself; what is played and
// what is checked comes from the server's reader.

const RENDERER = "/static/vendor/abcjs-basic-min.js";
let loading = null;

export function renderer() {
  if (window.ABCJS) return Promise.resolve(window.ABCJS);
  if (!loading) {
    loading = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = RENDERER;
      script.onload = () => resolve(window.ABCJS);
      script.onerror = () => { loading = null; reject(new Error("the notation renderer did not load")); };
      document.head.appendChild(script);
    });
  }
  return loading;
}

// Draw `text` into `element` (replacing what it held), unless `wanted()` says no once the renderer is loaded: one
// system a line of the score, as the dialect groups bars, each `% section` label (a comment to abcjs) shown as a
// part label (P:), laid out for `width` pixels (then scaled to the element's width). Whether it drew.
export async function drawNotation(element, text, width, wanted = () => true) {
  const ABCJS = await renderer();
  if (!wanted()) return false;
  ABCJS.renderAbc(element, text.replace(/^% (.+)$/gm, "P:$1"), {
    add_classes: true, responsive: "resize", foregroundColor: "currentColor", staffwidth: Math.max(480, width - 40),
    paddingtop: 4, paddingbottom: 4, paddingleft: 4, paddingright: 12,
  });
  return true;
}
