// The page: a model, its adapters and images, a batch of (image, adapter) rows run as one
// engine call on WebGPU, and what the desktop demo shows of the run. The engine and the
// analysis are the library's (web/src/lib.rs); this file moves files in and draws results.

import init, { Gpu, Session, colormap, decodeImage } from './pkg/mmlora_web.js';

const $ = (id) => document.getElementById(id);

// What the page holds; `window.mmlora` for the tests and the console.
const page = {
  gpu: null,
  session: null,
  // The page's images: { path (as the engine reads it), name, url (for drawing), bytes }.
  images: [],
  // Images the user added, re-added to each model opened after them.
  userImages: [],
  batch: [],
  summary: null,
  runs: 0,
  errors: [],
  // The output `what` (embeds, tower, deepstack) of the last run's request `index`.
  output(index, what) {
    const out = page.session.output(index, what);
    return { rows: out.rows, columns: out.columns, values: Array.from(out.values) };
  },
  // The page's image at `path` decoded as the engine decodes it.
  decoded(path) {
    const entry = page.images.find((image) => image.path === path);
    const image = decodeImage(entry.name, entry.bytes);
    return { width: image.width, height: image.height, rgb: Array.from(image.rgb) };
  },
};
window.mmlora = page;

const setState = (state) => { document.body.dataset.state = state; };

function messageOf(error) {
  return error instanceof Error ? error.message : String(error);
}

// Shows an error; `what` (a file's or adapter's name) leads the message unless it names it.
function report(what, error) {
  const message = messageOf(error);
  const text = message.includes(what) ? message : `${what}: ${message}`;
  page.errors.push(text);
  console.error(text);
  const item = document.createElement('li');
  item.textContent = text;
  $('error-list').append(item);
  $('errors').hidden = false;
}

// Runs `work`, reporting a failure as `what`; the page stays as it was before it.
async function guard(what, work) {
  const before = document.body.dataset.state;
  setState('busy');
  try {
    return await work();
  } catch (error) {
    report(what, error);
    return undefined;
  } finally {
    setState(before === 'busy' ? 'ready' : before);
    render();
  }
}

const bytesOf = async (file) => new Uint8Array(await file.arrayBuffer());

async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

function imageEntry(path, name, bytes) {
  const url = URL.createObjectURL(new Blob([bytes]));
  return { path, name, url, bytes };
}

// --- Models -----------------------------------------------------------------------------

// Opens a model from its files ([path inside the folder, bytes] pairs); on success the new
// session replaces the old one, with the user's images added again.
function openModel(name, files) {
  const session = Session.open(page.gpu, name, files);
  const images = [];
  try {
    for (const image of page.userImages) {
      images.push(imageEntry(session.addImage(image.name, image.bytes), image.name, image.bytes));
    }
  } catch (error) {
    session.free();
    throw error;
  }
  if (page.session) page.session.free();
  page.session = session;
  page.images = images;
  page.batch = [];
  page.summary = null;
  $('model-info').textContent = `${session.folder}: ${files.length} files`;
  return session;
}

// A bundled model served beside the page (models/<name>/, listed in models/index.json),
// with its adapters, images and example batch.
async function openBundled(name) {
  const listing = page.bundled[name];
  const files = await Promise.all(listing.map(async (path) =>
    [path, await fetchBytes(`models/${encodeURIComponent(name)}/${path}`)]));
  const session = openModel(name, files);
  const batch = JSON.parse(new TextDecoder().decode(files.find(([p]) => p === 'batch.json')[1]));
  for (const [adapter, path] of Object.entries(batch.adapters)) {
    session.loadModelAdapter(adapter, path);
  }
  const bundledImages = files.filter(([p]) => p.startsWith('images/'))
    .map(([path, bytes]) => imageEntry(`${session.folder}/${path}`, path.slice('images/'.length), bytes));
  page.images = bundledImages.concat(page.images);
  page.exampleBatch = batch.requests.map((r) => ({
    image: `${session.folder}/${r.image}`, adapter: r.adapter,
  }));
  page.batch = page.exampleBatch.map((row) => ({ ...row }));
}

// The files of a picked folder, grouped by their top folder: { name: [[path inside, file]] }.
function byFolder(fileList) {
  const folders = {};
  for (const file of fileList) {
    const parts = (file.webkitRelativePath || file.name).split('/');
    const top = parts.length > 1 ? parts[0] : '';
    (folders[top] ||= []).push([parts.slice(parts.length > 1 ? 1 : 0).join('/'), file]);
  }
  return folders;
}

const withBytes = (pairs) => Promise.all(pairs.map(async ([path, file]) => [path, await bytesOf(file)]));

async function openFolder(fileList) {
  for (const [name, pairs] of Object.entries(byFolder(fileList))) {
    await guard(name || 'the picked model folder', async () => {
      openModel(name || 'picked', await withBytes(pairs));
      page.exampleBatch = [];
    });
  }
}

// --- Adapters and images ------------------------------------------------------------------

let pickedAdapters = 0;

async function addAdapters(fileList, named) {
  const folders = byFolder(fileList);
  for (const [folder, pairs] of Object.entries(folders)) {
    const name = named || folder || `adapter-${++pickedAdapters}`;
    await guard(name, async () => {
      // Only the folder's top level: a PEFT folder holds its two files there.
      const top = pairs.filter(([path]) => !path.includes('/'));
      page.session.loadAdapter(name, await withBytes(top));
    });
  }
}

// Adds an image's bytes to the session (which checks that they decode) and to the page.
function addImage(name, bytes) {
  const path = page.session.addImage(name, bytes);
  page.images.push(imageEntry(path, name, bytes));
  page.userImages.push({ name, bytes });
}

async function addImageFiles(fileList) {
  for (const file of fileList) {
    await guard(file.name, async () => addImage(file.name, await bytesOf(file)));
  }
}

// --- Batch ----------------------------------------------------------------------------------

function option(value, text, selected) {
  const element = document.createElement('option');
  element.value = value;
  element.textContent = text;
  element.selected = selected;
  return element;
}

function renderBatch() {
  const body = $('batch').tBodies[0];
  body.replaceChildren();
  const adapters = page.session ? page.session.adapterNames() : [];
  page.batch.forEach((row, i) => {
    const tr = body.insertRow();
    tr.insertCell().textContent = i;
    const image = document.createElement('select');
    for (const entry of page.images) image.append(option(entry.path, entry.name, entry.path === row.image));
    image.onchange = () => { row.image = image.value; };
    tr.insertCell().append(image);
    const adapter = document.createElement('select');
    adapter.append(option('', 'none (base model)', row.adapter === null));
    for (const name of adapters) adapter.append(option(name, name, row.adapter === name));
    adapter.onchange = () => { row.adapter = adapter.value || null; };
    tr.insertCell().append(adapter);
    const remove = document.createElement('button');
    remove.type = 'button';
    remove.textContent = 'Remove';
    remove.onclick = () => { page.batch.splice(i, 1); render(); };
    tr.insertCell().append(remove);
  });
}

function renderLists() {
  const adapters = $('adapter-list');
  adapters.replaceChildren();
  for (const name of page.session ? page.session.adapterNames() : []) {
    const item = document.createElement('li');
    item.textContent = `${name} `;
    const remove = document.createElement('button');
    remove.type = 'button';
    remove.textContent = 'Unload';
    remove.onclick = () => guard(name, () => {
      page.session.unloadAdapter(name);
      for (const row of page.batch) if (row.adapter === name) row.adapter = null;
    });
    item.append(remove);
    adapters.append(item);
  }
  const images = $('image-list');
  images.replaceChildren();
  for (const entry of page.images) {
    const figure = document.createElement('figure');
    const img = document.createElement('img');
    img.src = entry.url;
    img.alt = entry.name;
    const caption = document.createElement('figcaption');
    caption.textContent = entry.name;
    figure.append(img, caption);
    images.append(figure);
  }
}

// --- Results ----------------------------------------------------------------------------------

const loadedImages = new Map();

function loadImage(url) {
  if (!loadedImages.has(url)) {
    const img = new Image();
    img.src = url;
    loadedImages.set(url, img.decode().then(() => img));
  }
  return loadedImages.get(url);
}

const css = ([r, g, b], alpha = 1) => `rgba(${r}, ${g}, ${b}, ${alpha})`;

// The image under its patches tinted by how far each moved (alpha 170/255, as the demo), and
// a colour bar from 0 to the largest change.
async function drawHeatmap(canvas, row) {
  const side = 240;
  const { rows, columns, values } = row.heat;
  const [width, height] = rows > columns ? [side * columns / rows, side] : [side, side * rows / columns];
  const bar = 70;
  canvas.width = Math.round(width + bar);
  canvas.height = Math.round(height);
  const context = canvas.getContext('2d');
  const entry = page.images.find((image) => image.path === row.image);
  if (entry) context.drawImage(await loadImage(entry.url), 0, 0, width, height);
  const max = values.reduce((a, b) => Math.max(a, b), 0);
  const cell = [width / columns, height / rows];
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < columns; c++) {
      const value = values[r * columns + c];
      context.fillStyle = css(colormap(max > 0 ? value / max : 0), 170 / 255);
      context.fillRect(c * cell[0], r * cell[1], cell[0], cell[1]);
    }
  }
  const steps = 48;
  for (let i = 0; i < steps; i++) {
    context.fillStyle = css(colormap(1 - i / steps));
    context.fillRect(width + 8, i * height / steps, 14, height / steps + 0.5);
  }
  context.fillStyle = '#222';
  context.font = '11px sans-serif';
  context.fillText(max.toPrecision(3), width + 26, 10);
  context.fillText('0', width + 26, height - 2);
}

function renderResults() {
  const summary = page.summary;
  const body = $('results').tBodies[0];
  body.replaceChildren();
  $('heatmaps').replaceChildren();
  $('cosine').replaceChildren();
  if (!summary) {
    $('timing').textContent = 'Nothing run yet.';
    return;
  }
  $('timing').textContent = `${(summary.seconds * 1e3).toFixed(1)} ms for ${summary.requests} ` +
    `requests (the rows, and each image once without adapter as the base) on ${summary.device}.`;
  summary.rows.forEach((row, i) => {
    const tr = body.insertRow();
    const name = page.images.find((image) => image.path === row.image)?.name ?? row.image;
    for (const value of [i, name, row.adapter ?? 'none', row.tower_tokens, row.embeds,
      `${(row.moved * 100).toFixed(2)} %`, row.step, row.step_ms.toFixed(1)]) {
      tr.insertCell().textContent = value;
    }
    const figure = document.createElement('figure');
    const canvas = document.createElement('canvas');
    canvas.className = 'heatmap';
    const caption = document.createElement('figcaption');
    caption.textContent = `#${i} ${name} · ${row.adapter ?? 'none'}`;
    figure.append(canvas, caption);
    $('heatmaps').append(figure);
    drawHeatmap(canvas, row).catch((error) => report(`heatmap ${i}`, error));
  });
  const cosine = $('cosine');
  const head = cosine.insertRow();
  head.insertCell();
  summary.cosine.forEach((_, i) => { head.insertCell().textContent = `#${i}`; });
  summary.cosine.forEach((values, i) => {
    const tr = cosine.insertRow();
    tr.insertCell().textContent = `#${i}`;
    for (const value of values) {
      const td = tr.insertCell();
      td.textContent = value.toFixed(4);
      td.style.background = css(colormap(value), 0.6);
    }
  });
}

function renderErrors() {
  $('errors').hidden = page.errors.length === 0;
}

function render() {
  renderLists();
  renderBatch();
  renderErrors();
  $('run').disabled = !page.session || page.batch.length === 0;
}

async function run() {
  await guard('run', async () => {
    setState('running');
    const rows = page.batch.map(({ image, adapter }) => ({ image, adapter }));
    page.summary = JSON.parse(await page.session.run(JSON.stringify(rows)));
    page.runs += 1;
    renderResults();
  });
}

// --- Wiring ---------------------------------------------------------------------------------

function wire() {
  $('model-select').onchange = (event) => guard(event.target.value, async () => {
    await openBundled(event.target.value);
    renderResults();
  });
  $('model-folder').onchange = async (event) => {
    await openFolder(event.target.files);
    event.target.value = '';
    renderResults();
  };
  $('adapter-folder').onchange = async (event) => {
    await addAdapters(event.target.files);
    event.target.value = '';
  };
  $('adapter-files').onchange = async (event) => {
    await addAdapters(event.target.files, null);
    event.target.value = '';
  };
  $('image-files').onchange = async (event) => {
    await addImageFiles(event.target.files);
    event.target.value = '';
  };
  $('image-url').onsubmit = async (event) => {
    event.preventDefault();
    const url = $('image-url-text').value;
    const name = decodeURIComponent(new URL(url, location.href).pathname.split('/').pop() || 'image');
    await guard(url, async () => addImage(name, await fetchBytes(url)));
  };
  document.addEventListener('dragover', (event) => event.preventDefault());
  document.addEventListener('drop', async (event) => {
    event.preventDefault();
    await addImageFiles(event.dataTransfer.files);
  });
  $('add-row').onclick = () => {
    page.batch.push({ image: page.images[0]?.path ?? '', adapter: null });
    render();
  };
  $('bundled-batch').onclick = () => {
    page.batch = (page.exampleBatch ?? []).map((row) => ({ ...row }));
    render();
  };
  $('run').onclick = run;
  $('clear-errors').onclick = () => {
    page.errors = [];
    $('error-list').replaceChildren();
    render();
  };
}

// The WebGPU adapter's name as the browser gives it (vendor, architecture, description).
async function adapterName() {
  const adapter = navigator.gpu && await navigator.gpu.requestAdapter();
  const info = adapter?.info ?? {};
  return [info.vendor, info.architecture, info.device, info.description]
    .filter(Boolean).join(' ') || 'an unnamed adapter';
}

async function start() {
  await init();
  wire();
  try {
    page.gpu = await Gpu.open(await adapterName());
    $('gpu').textContent = `GPU: ${page.gpu.name}`;
  } catch (error) {
    $('gpu').textContent = 'GPU: none — this browser offers no WebGPU adapter (see the README for which browsers do).';
    report('WebGPU', error);
    setState('no-gpu');
    return;
  }
  page.bundled = await (await fetch('models/index.json')).json();
  const select = $('model-select');
  const wanted = new URLSearchParams(location.search).get('model') ?? Object.keys(page.bundled)[0];
  for (const name of Object.keys(page.bundled)) select.append(option(name, name, name === wanted));
  await guard(wanted, () => openBundled(wanted));
  setState('ready');
}

start().catch((error) => { report('start', error); setState('failed'); });
