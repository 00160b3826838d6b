// The JavaScript SDK's Template builder, unchanged, against an agentenv node (run by
// tests/test_e2b_js.py): build with a COPY and a start command, then start a sandbox.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { randomUUID } from 'node:crypto'
import { promisify } from 'node:util'
import { BuildError, Sandbox, Template, waitForPort } from 'e2b'

test('Template.build, then Sandbox.create of the built template', async () => {
  const ctx = mkdtempSync(join(tmpdir(), 'aenv-js-tpl-'))
  writeFileSync(join(ctx, 'js.txt'), 'from the js context\n')
  const name = `xbt-js-${randomUUID().slice(0, 6)}`
  const template = Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .runCmd('echo js-build-as-$(whoami)')
    .copy('js.txt', '/opt/js.txt')
    .setEnvs({ JSV: 'yes' })
    .setStartCmd('python3 -m http.server 8001', waitForPort(8001))
  const logs = []
  const info = await Template.build(template, name, { onBuildLogs: (e) => logs.push(e.message) })
  assert.ok(logs.includes('js-build-as-user'), logs.join('\n'))
  const sbx = await Sandbox.create(name)
  try {
    const r = await sbx.commands.run(
      'cat /opt/js.txt; echo $JSV; curl -s -o /dev/null -w "%{http_code}" localhost:8001/')
    assert.equal(r.stdout, 'from the js context\nyes\n200')
  } finally {
    await sbx.kill()
  }
  const failing = Template().fromTemplate('base').runCmd('echo js-doomed; exit 4')
  await assert.rejects(Template.build(failing, `${name}-fail`), (err) => {
    assert.ok(err instanceof BuildError, String(err))
    assert.match(err.message, /exit code 4[\s\S]*js-doomed/)
    return true
  })
  const res = await fetch(`${process.env.E2B_API_URL}/templates/${info.templateId}`, {
    method: 'DELETE', headers: { 'X-API-Key': process.env.E2B_API_KEY } })
  assert.equal(res.status, 204)
})

test('e2b template create (the E2B CLI) builds a Dockerfile; e2b template delete', async () => {
  const run = promisify(execFile)
  const CLI = join(import.meta.dirname, 'node_modules', '@e2b', 'cli', 'dist', 'index.js')
  const env = { ...process.env, HOME: mkdtempSync(join(tmpdir(), 'e2b-cli-')), NO_COLOR: '1' }
  const dir = mkdtempSync(join(tmpdir(), 'aenv-js-df-'))
  writeFileSync(join(dir, 'page.txt'), 'page from the cli context\n')
  writeFileSync(join(dir, 'Dockerfile'),
    'FROM e2bdev/base\nENV MODE=e2b-cli\nCOPY page.txt /srv/page.txt\nRUN cat /srv/page.txt\n')
  const name = `xbt-e2bcli-${randomUUID().slice(0, 6)}`
  await run(process.execPath, [CLI, 'template', 'create', name, '-p', dir],
    { env, timeout: 120_000 })
  const sbx = await Sandbox.create(name)
  try {
    const r = await sbx.commands.run('cat /srv/page.txt; echo $MODE')
    assert.equal(r.stdout, 'page from the cli context\ne2b-cli\n')
  } finally {
    await sbx.kill()
  }
  await run(process.execPath, [CLI, 'template', 'delete', name, '-y'], { env, timeout: 60_000 })
  await assert.rejects(Sandbox.create(name))
})
