// @e2b/code-interpreter (unchanged) against agentenv's code-interpreter template.
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

let sbx

before(async () => {
  sbx = await Sandbox.create({ timeoutMs: 300_000 })
})

after(async () => {
  await sbx?.kill()
})

test('runCode: results, stdout, state between calls', async () => {
  const stdout = []
  const first = await sbx.runCode("n = 20\nprint('from js')\nn * 2", {
    onStdout: (m) => stdout.push(m.line),
  })
  assert.equal(first.error, undefined)
  assert.equal(first.text, '40')
  assert.deepEqual(first.logs.stdout, ['from js\n'])
  assert.deepEqual(stdout, ['from js\n'])
  assert.equal((await sbx.runCode('n + 1')).text, '21')
})

test('runCode: errors with traceback', async () => {
  const execution = await sbx.runCode("raise ValueError('nope')")
  assert.equal(execution.error.name, 'ValueError')
  assert.equal(execution.error.value, 'nope')
  assert.match(execution.error.traceback, /ValueError/)
})

test('contexts', async () => {
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp')
  await sbx.removeCodeContext(ctx.id)
})

test('languages: a default JavaScript context, env vars per run', async () => {
  const languages = (await sbx.listCodeContexts()).map((c) => c.language)
  assert.ok(languages.includes('python') && languages.includes('javascript'))
  const run = await sbx.runCode('console.log(process.env.PER_RUN ?? "-")', {
    language: 'js',
    envs: { PER_RUN: 'set' },
  })
  assert.deepEqual(run.logs.stdout, ['set\n'])
  const after = await sbx.runCode('console.log(process.env.PER_RUN ?? "-")', { language: 'js' })
  assert.deepEqual(after.logs.stdout, ['-\n'])
  assert.equal((await sbx.runCode("'hello'")).text, 'hello')
})
