// The E2B CLI (npm @e2b/cli, unchanged) lists the node's templates and sandboxes.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { Sandbox } from 'e2b'

const run = promisify(execFile)
const CLI = join(import.meta.dirname, 'node_modules', '@e2b', 'cli', 'dist', 'index.js')
// A HOME of its own: no user config, the API key comes from E2B_API_KEY.
const env = { ...process.env, HOME: mkdtempSync(join(tmpdir(), 'e2b-cli-')), NO_COLOR: '1' }

async function cli(...args) {
  const { stdout } = await run(process.execPath, [CLI, ...args], { env, timeout: 60_000 })
  return stdout
}

test('e2b template list', async () => {
  const templates = JSON.parse(await cli('template', 'list', '--format', 'json'))
  const ids = templates.map((t) => t.templateID)
  assert.ok(ids.includes('base'))
  assert.ok(ids.includes('code-interpreter'))
  const base = templates.find((t) => t.templateID === 'base')
  assert.equal(base.buildStatus, 'ready')
  assert.match(await cli('template', 'list'), /base/)
})

test('e2b sandbox list', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 60_000, metadata: { via: 'cli-test' } })
  try {
    const listed = JSON.parse(await cli('sandbox', 'list', '--format', 'json', '-m', 'via=cli-test'))
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
  } finally {
    await sbx.kill()
  }
})
