// onnxopt diff, the live page: reaches into the two Netron iframes (same origin) to mark nodes and
// bring a chosen node into view. The mapping's shape is documented in onnxopt/diff_live.py.
'use strict';

const SHOWN = 6;  // replaced nodes listed in a table row before the count

const MARK_CSS = `
g.onnxopt-mark > .node.node-border { stroke-width: 5px; }
g.onnxopt-created > .node.node-border { stroke: #1a9c2c; }
g.onnxopt-fused > .node.node-border { stroke: #7a2ad6; }
g.onnxopt-changed > .node.node-border { stroke: #e08a00; }
g.onnxopt-removed > .node.node-border { stroke: #d61a1a; }
g.onnxopt-replaced > .node.node-border { stroke: #d61a1a; stroke-dasharray: 6 3; }
g.onnxopt-removed, g.onnxopt-replaced { opacity: 0.75; }
g.onnxopt-mark.select > .node.node-border { stroke: #0050ff; stroke-width: 7px; }
`;

const state = { mapping: null, marks: { before: {}, after: {} }, applied: { before: [], after: [] },
                missing: { before: [], after: [] }, ready: { before: false, after: false }, chosen: null };
window.onnxoptDiff = state;

function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
}

function computeMarks(m) {
    const before = {}, after = {};
    for (const c of m.created) {
        const replaced = c.replaced || [];
        const kind = replaced.length > 1 ? 'fused' : 'created';
        after[c.after] = kind;
        for (const r of replaced) before[r] = kind === 'fused' ? 'fused' : 'replaced';
    }
    for (const c of m.changed) {
        if (c.before) before[c.before] = before[c.before] || 'changed';
        if (c.after) after[c.after] = after[c.after] || 'changed';
    }
    for (const r of m.removed) before[r] = before[r] || 'removed';
    return { before, after };
}

function renderSummary(m) {
    const s = m.summary || {};
    const body = document.getElementById('summary-body');
    body.textContent = '';
    const files = m.files || {};
    document.getElementById('title-before').textContent = `before: ${files.before || ''}`;
    document.getElementById('title-after').textContent = `after: ${files.after || ''}`;
    const nb = Object.values(s.ops_before || {}).reduce((a, b) => a + b, 0);
    const na = Object.values(s.ops_after || {}).reduce((a, b) => a + b, 0);
    const counts = el('div');
    counts.appendChild(el('div', `nodes ${nb} -> ${na}; created ${m.created.length}, removed ${m.removed.length}, changed ${m.changed.length}`));
    const ops = el('table');
    ops.id = 'op-counts';
    const head = el('tr');
    ['op type', 'before', 'after'].forEach((t) => head.appendChild(el('th', t)));
    ops.appendChild(head);
    const names = new Set([...Object.keys(s.ops_before || {}), ...Object.keys(s.ops_after || {})]);
    for (const op of names) {
        const b = (s.ops_before || {})[op] || 0, a = (s.ops_after || {})[op] || 0;
        if (a === b) continue;
        const tr = el('tr');
        [op, b, a].forEach((t) => tr.appendChild(el('td', t)));
        ops.appendChild(tr);
    }
    counts.appendChild(ops);
    body.appendChild(counts);
    const rules = el('table');
    rules.id = 'rules-fired';
    const rh = el('tr');
    ['rule fired', 'nodes it made'].forEach((t) => rh.appendChild(el('th', t)));
    rules.appendChild(rh);
    for (const [rule, n] of Object.entries(s.rules || {})) {
        const tr = el('tr');
        [rule, n].forEach((t) => tr.appendChild(el('td', t)));
        rules.appendChild(tr);
    }
    body.appendChild(rules);
    if (Array.isArray(s.verify) && s.verify.length) {  // from --verify-report: kernels and latency per provider
        const v = el('table');
        v.id = 'verify';
        const vh = el('tr');
        ['provider', 'kernels before', 'kernels after', 'median ms before', 'median ms after', 'latency'].forEach((t) => vh.appendChild(el('th', t)));
        v.appendChild(vh);
        const num = (x) => (typeof x === 'number' ? String(+x.toFixed(3)) : '');
        for (const r of s.verify) {
            const tr = el('tr');
            [r.provider, num(r.kernels_before), num(r.kernels_after), num(r.latency_ms_before), num(r.latency_ms_after),
             typeof r.latency_verdict === 'string' ? r.latency_verdict : '']
                .forEach((t) => tr.appendChild(el('td', t)));
            v.appendChild(tr);
        }
        body.appendChild(v);
    }
}

function renderTable(m) {
    const tbody = document.querySelector('#created tbody');
    m.created.forEach((c, i) => {
        const tr = el('tr');
        tr.dataset.after = c.after;
        tr.dataset.index = i;
        tr.appendChild(el('td', c.after));
        tr.appendChild(el('td', c.rule || ''));
        // a fusion can stand for dozens of nodes: the first few, a count, the whole list on hover
        const replaced = c.replaced || [];
        const shown = replaced.length > SHOWN ? `${replaced.slice(0, SHOWN).join(', ')}, ... (${replaced.length} in all)` : replaced.join(', ');
        const td = el('td', shown);
        td.title = replaced.join('\n');
        tr.appendChild(td);
        tr.addEventListener('click', () => choose(i));
        tbody.appendChild(tr);
    });
}

function frameOf(side) {
    const w = document.getElementById(side).contentWindow;
    return w && w.document ? w : null;
}

function graphReady(w) {
    const view = w && w.__view__;
    if (!view || !view.target) return false;
    const nodes = w.document.getElementById('nodes');
    return !!nodes && nodes.querySelector('g.node') !== null;
}

function applyMarks(side) {
    const w = frameOf(side);
    const doc = w.document;
    if (!doc.getElementById('onnxopt-style')) {
        const style = doc.createElement('style');
        style.id = 'onnxopt-style';
        style.textContent = MARK_CSS;
        doc.head.appendChild(style);
    }
    const applied = [], missing = [];
    for (const [name, kind] of Object.entries(state.marks[side])) {
        const g = doc.getElementById(`node-name-${name}`);
        if (!g) { missing.push(name); continue; }
        g.classList.add('onnxopt-mark', `onnxopt-${kind}`);
        g.setAttribute('data-onnxopt', kind);
        applied.push(name);
    }
    state.applied[side] = applied;
    state.missing[side] = missing;
    const gone = state.missing.before.length + state.missing.after.length;
    document.getElementById('notdrawn').textContent = gone === 0 ? '' :
        `${gone} marked node(s) not drawn by Netron (it shows Constant nodes as their consumers' inputs; unnamed nodes have no name to find)`;
}

// Select the named nodes in one Netron view and scroll them into view (Netron's own select/scrollTo).
function focusIn(side, names) {
    const w = frameOf(side);
    if (!w || !state.ready[side]) return [];
    const target = w.__view__.target;
    const ids = new Set(names.map((n) => `node-name-${n}`));
    const values = [];
    // (the iframe's Map is another realm's: no instanceof)
    if (target && target._table && typeof target._table.entries === 'function') {
        for (const [value, obj] of target._table.entries()) {
            if (obj && ids.has(obj.id)) values.push(value);
        }
    }
    if (values.length > 0 && typeof target.select === 'function') {
        const elements = target.select(values);
        target.scrollTo(elements, 'instant');
        return names.filter((n) => w.document.getElementById(`node-name-${n}`));
    }
    // Fallback (a Netron whose internals moved): scroll the first element into view.
    const found = names.map((n) => w.document.getElementById(`node-name-${n}`)).filter(Boolean);
    if (found.length) found[0].scrollIntoView({ block: 'center', inline: 'center' });
    return found.map((g) => g.id.slice('node-name-'.length));
}

function choose(index) {
    const c = state.mapping.created[index];
    document.querySelectorAll('#created tbody tr').forEach((tr) => tr.classList.toggle('chosen', +tr.dataset.index === index));
    state.chosen = { index, after: focusIn('after', [c.after]), before: focusIn('before', c.replaced || []) };
    return state.chosen;
}
state.choose = choose;

function watch(side) {
    const tick = () => {
        const w = frameOf(side);
        if (w && graphReady(w)) {
            state.ready[side] = true;
            applyMarks(side);
            // Netron rebuilds its SVG when the user changes the view (e.g. shows attributes): mark again.
            const obs = new w.MutationObserver(() => {
                const g = w.document.getElementById('nodes');
                if (g && !g.querySelector('g.onnxopt-mark') && Object.keys(state.marks[side]).length) applyMarks(side);
            });
            obs.observe(w.document.getElementById('target'), { childList: true, subtree: false });
            return;
        }
        setTimeout(tick, 200);
    };
    tick();
}

async function main() {
    const response = await fetch('mapping.json');
    const m = await response.json();
    state.mapping = m;
    state.marks = computeMarks(m);
    renderSummary(m);
    renderTable(m);
    watch('before');
    watch('after');
}

main().catch((e) => { document.getElementById('summary-body').textContent = `error: ${e}`; });
