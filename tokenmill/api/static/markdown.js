// Markdown as the model writes it (paragraphs, fenced code, headings, lists, quotes, `code`, **bold**, *italic*,
// links), built as DOM nodes: every piece of text is a text node, so nothing the model writes is ever parsed as HTML.
import { el } from "./common.js";

const FENCE = /^\s*(```|~~~)\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\(https?:\/\/[^\s)]+\))/g;

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) body.push(lines[i]);
      i += 1; // the closing fence, or the end of a reply still streaming
      const pre = el("pre");
      const code = el("code", fence[2] ? `language-${fence[2]}` : "", body.join("\n"));
      pre.append(code);
      root.append(pre);
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      root.append(inline(el(`h${Math.min(heading[1].length + 1, 4)}`), heading[2]));
      i += 1;
      continue;
    }
    if (BULLET.test(line) || NUMBERED.test(line)) {
      const pattern = BULLET.test(line) ? BULLET : NUMBERED;
      const list = el(pattern === BULLET ? "ul" : "ol");
      for (; i < lines.length && pattern.test(lines[i]); i += 1) list.append(inline(el("li"), lines[i].match(pattern)[1]));
      root.append(list);
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i += 1) quoted.push(lines[i].match(QUOTE)[1]);
      root.append(inline(el("blockquote"), quoted.join("\n")));
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i += 1) paragraph.push(lines[i]);
    root.append(inline(el("p"), paragraph.join("\n")));
  }
  return root;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line) || QUOTE.test(line);
}

// Text with inline code, bold, italic and http(s) links appended to parent.
function inline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(document.createTextNode(text.slice(last, match.index)));
    const [token] = match;
    if (match[1]) parent.append(el("code", "", token.slice(1, -1)));
    else if (match[2]) parent.append(el("strong", "", token.slice(2, -2)));
    else if (match[3]) parent.append(el("em", "", token.slice(1, -1)));
    else {
      const split = token.indexOf("](");
      const link = el("a", "", token.slice(1, split));
      link.href = token.slice(split + 2, -1); // http(s) only: the pattern allows no other scheme
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      parent.append(link);
    }
    last = match.index + token.length;
  }
  parent.append(document.createTextNode(text.slice(last)));
  return parent;
}
