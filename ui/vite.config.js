// `make ui` builds the console into ui/dist, which the node and the gateway serve at /ui/.
import { defineConfig } from "vite";

export default defineConfig({
  base: "/ui/",
  build: { outDir: "dist", emptyOutDir: true, assetsDir: "assets", chunkSizeWarningLimit: 1024 },
});
