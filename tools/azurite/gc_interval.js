// Loaded into Azurite's Node process (NODE_OPTIONS=--require) by tools/azurite/__main__.py for an
// in-memory Azurite (tests, the chaos soak, benchmarks): its blob garbage collection runs every
// AZURITE_GC_SECONDS instead of every 10 minutes. Azurite 3.37 deletes each unreferenced extent
// from an indexed collection one at a time, on its only thread: 10 minutes into a chaos soak (a few
// thousand stream logs swept) that blocked every table and blob call for over a minute, and each
// instance saw its store down. A short-lived in-memory Azurite keeps its garbage instead.
const path = require("path");
const constants = require(path.join(__dirname, "node_modules", "azurite", "dist", "src", "blob", "utils", "constants.js"));
if (!("DEFAULT_GC_INTERVAL_MS" in constants)) {
  throw new Error("tools/azurite/gc_interval.js: this Azurite has no DEFAULT_GC_INTERVAL_MS (see package-lock.json)");
}
constants.DEFAULT_GC_INTERVAL_MS = 1000 * Number(process.env.AZURITE_GC_SECONDS || 86400);
