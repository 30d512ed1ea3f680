// What both pages share: requests to this server with the API key when one is set, and the dialog that asks for it.
const KEY = "tokenmill-api-key";

export class KeyNeeded extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

// fetch() on this server's API: JSON bodies, the key as a Bearer token; a 401 opens the key dialog.
export async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  if (init.body !== undefined) headers["Content-Type"] = "application/json";
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) {
    askForKey();
    throw new KeyNeeded("this server needs an API key");
  }
  return response;
}

// The OpenAI error object's message, or the status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

let onKeySaved = () => {};

export function whenKeySaved(callback) {
  onKeySaved = callback;
}

export function askForKey() {
  const dialog = document.getElementById("key-dialog");
  if (dialog.open) return;
  const input = dialog.querySelector("input");
  input.value = apiKey();
  dialog.showModal();
}

// The dialog both pages open on a 401, and their header's "API key" button.
export function setUpKeyDialog() {
  const dialog = el("dialog");
  dialog.id = "key-dialog";
  const form = el("form");
  form.method = "dialog";
  const input = el("input");
  Object.assign(input, { type: "password", autocomplete: "off", placeholder: "API key" });
  const save = el("p");
  save.append(el("button", "", "Save"));
  form.append(el("p", "", "This server asks for an API key (--api-key). It is kept in this browser only."), input, save);
  dialog.append(form);
  document.body.append(dialog);
  form.addEventListener("submit", () => {
    const key = dialog.querySelector("input").value.trim();
    if (key) localStorage.setItem(KEY, key);
    else localStorage.removeItem(KEY);
    onKeySaved();
  });
  document.getElementById("key-button").addEventListener("click", askForKey);
}

// An element with text content only: model and user text never become HTML.
export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
