// Inspects a running kvtrie-server the way grpcurl does, with no .proto files: through server
// reflection (v1alpha, what gRPC 1.51 serves) only. Used by tests/e2e_test.cc.
//
//   node reflect.js HOST:PORT
//
// Lists the services, describes kvtrie.v1.KVCache and grpc.health.v1.Health from their
// reflected descriptors, then calls KVCache/Stats and Health/Check with clients built from those
// descriptors. Prints one JSON object; exits non-zero on any failure.
const grpc = require('@grpc/grpc-js');
const { GrpcReflection } = require('grpc-js-reflection-client');

const host = process.argv[2];
const insecure = () => grpc.ChannelCredentials.createInsecure();

function call(client, method, request) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + 10000);
    client[method](request, { deadline }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

async function serviceClient(reflection, symbol) {
  const descriptor = await reflection.getDescriptorBySymbol(symbol);
  const pkg = descriptor.getPackageObject({ keepCase: true, longs: String, enums: String, defaults: true });
  const Service = symbol.split('.').reduce((o, part) => o[part], pkg);
  if (typeof Service !== 'function') throw new Error(`cannot build a client for ${symbol}`);
  return { client: new Service(host, insecure()), methods: Object.keys(Service.service) };
}

(async () => {
  const reflection = new GrpcReflection(host, insecure());
  const services = await reflection.listServices();
  const kv = await serviceClient(reflection, 'kvtrie.v1.KVCache');
  const health = await serviceClient(reflection, 'grpc.health.v1.Health');
  const stats = await call(kv.client, 'Stats', {});
  const serving = await call(health.client, 'Check', { service: 'kvtrie.v1.KVCache' });
  console.log(JSON.stringify({ services, kvcache_methods: kv.methods, health_methods: health.methods,
                               stats, health: serving.status }));
  process.exit(0);
})().catch((err) => {
  console.error(`reflect.js: ${err && err.stack ? err.stack : err}`);
  process.exit(1);
});
