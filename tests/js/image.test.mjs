// A sandbox straight from an OCI image through the official e2b JavaScript SDK: the
// template name `docker://REF` (agentenv's image scheme). The image is pushed by
// tests/test_images_create.py, which runs this file with AENV_TEST_IMAGE_REF set;
// without it (the plain JS run) there is no registry to pull from.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const ref = process.env.AENV_TEST_IMAGE_REF

test('create from an image reference', { skip: !ref && 'no AENV_TEST_IMAGE_REF' }, async () => {
  const sbx = await Sandbox.create(`docker://${ref}`, { timeoutMs: 120_000 })
  try {
    assert.match((await sbx.getInfo()).templateId, /^img-[0-9a-f]{16}$/)
    const marker = ref.split('/').pop().split(':')[0]
    const r = await sbx.commands.run('cat /opt/marker; echo $MARKER')
    assert.deepEqual(r.stdout.split('\n').filter(Boolean), [marker, marker])
  } finally {
    await sbx.kill()
  }
  await assert.rejects(Sandbox.create('docker://Not A Reference'), /bad/)
})
