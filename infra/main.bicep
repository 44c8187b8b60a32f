// Entry point for `azd up`: one resource group holding the chat function app and what it needs.
// Parameters come from infra/main.parameters.json, which maps them to azd environment values
// (`azd env set NAME VALUE`). docs/deploy.md explains each choice.
targetScope = 'subscription'

@minLength(1)
@maxLength(64)
@description('Name of the azd environment. Names the resource group and seeds every resource name.')
param environmentName string

@minLength(1)
@description('Region for all resources. It must offer the Flex Consumption plan (az functionapp list-flexconsumption-locations).')
param location string

@allowed([
  'azureOpenAI'
  'openAI'
])
@description('Where completions come from: an Azure OpenAI account created here and reached keylessly with the app identity, or OpenAI (or any OpenAI-compatible server) with an API key kept in Key Vault.')
param upstream string = 'azureOpenAI'

// The default model: a GA version that new customers can still deploy when this was checked. Azure
// stops new deployments of a GA version 12 months after its release and retires it later; the
// table of what was checked, and when, is in docs/deploy.md ("The model"), and tests/test_infra.py
// fails once the default is past either date.
@description('Model name. In azureOpenAI mode the model deployed in the account; in openAI mode the default OPENAI_MODEL.')
param modelName string = 'gpt-5.4-mini'

@description('Model version to deploy (azureOpenAI mode).')
param modelVersion string = '2026-03-17'

// OnceCurrentVersionExpired: the deployment keeps the version chosen here (the one its answers,
// prices and limits were checked against) and Azure moves it to the default version only when this
// one is retired, so a retirement changes the model instead of failing every request. The other
// choices: OnceNewDefaultVersionAvailable (Azure's default: the version changes under a running
// app whenever Azure names a new default) and NoAutoUpgrade (the deployment stops answering at
// retirement).
@allowed([
  'OnceCurrentVersionExpired'
  'OnceNewDefaultVersionAvailable'
  'NoAutoUpgrade'
])
@description('versionUpgradeOption of the model deployment (azureOpenAI mode): when Azure may move it to another model version.')
param modelVersionUpgradeOption string = 'OnceCurrentVersionExpired'

@description('Deployment name in the Azure OpenAI account (azureOpenAI mode). Empty: the model name.')
param deploymentName string = ''

@allowed([
  'GlobalStandard'
  'Standard'
  'DataZoneStandard'
])
@description('Deployment type of the model (azureOpenAI mode).')
param deploymentSku string = 'GlobalStandard'

// Azure OpenAI counts a request against the deployment's tokens per minute as it arrives: its prompt
// plus its output cap. With caller keys the app sends DEFAULT_MAX_OUTPUT_TOKENS (4,096, resources.bicep)
// as the cap of a request that names none, so a typical request (1,000 prompt tokens) counts 5,096:
// 250 units (250,000 TPM; gpt-5.4-mini GlobalStandard also gets 250 RPM) admit 49 such requests a
// minute, 10 units 1. Tier 1 quota for gpt-5.4-mini GlobalStandard is 1,000 units per subscription
// (docs/deploy.md, "Capacity"; tests/test_infra.py checks the figure there).
@minValue(1)
@description('Capacity of the model deployment, in units of 1,000 tokens per minute (azureOpenAI mode).')
param deploymentCapacity int = 250

@description('Region of the Azure OpenAI account, when the model is not offered in the app region. Empty: same as location.')
param openAiLocation string = ''

// Empty: Azure OpenAI's GA v1 API (/openai/v1, no api-version), as the app's own default
// (chatstream/settings.py; tests/test_infra.py checks). A dated version (2024-10-21) selects that API.
@description('AZURE_OPENAI_API_VERSION for the app (azureOpenAI mode). Empty: the GA v1 API.')
param azureOpenAiApiVersion string = ''

@secure()
@description('OpenAI API key (openAI mode). Stored as a Key Vault secret; the app setting only references it.')
param openAiApiKey string = ''

@description('OPENAI_API_KEY_IN_VAULT (openAI mode): the key is kept and rotated in the Key Vault this template made (secret openai-api-key): the deployment needs no openAiApiKey and leaves the secret as it is.')
param openAiKeyInVault bool = false

@description('OPENAI_BASE_URL (openAI mode): another OpenAI-compatible server. Empty: api.openai.com. A server that wants no key (vLLM inside the virtual network) needs no openAiApiKey.')
param openAiBaseUrl string = ''

@description('Object id of the person or pipeline running azd (AZURE_PRINCIPAL_ID). Gets data-plane access for trying things out; empty: none.')
param principalId string = ''

@allowed([
  'User'
  'ServicePrincipal'
])
@description('Kind of principalId (AZURE_PRINCIPAL_TYPE): User for a person, ServicePrincipal for a pipeline signed in as one. A wrong kind fails the role assignments.')
param principalType string = 'User'

@description('Network isolation (VNET_ENABLED): a virtual network the app is integrated with, and storage, Azure OpenAI and Key Vault reachable only through private endpoints there. Off: public endpoints, identity-only access.')
param vnetEnabled bool = false

@description('With vnetEnabled (VNET_NAT_GATEWAY): a NAT gateway with a static public IP, the app subnet\'s way out to the internet (api.openai.com, Application Insights ingestion). Off: the network has no way out; refused in openAI mode without OPENAI_BASE_URL.')
param natGateway bool = true

@description('Zone redundancy (AZURE_ZONE_REDUNDANT): a zone-redundant Flex Consumption plan (at least two always-ready instances) and zone-redundant storage. The region must offer it.')
param zoneRedundant bool = false

@description('Key Vault purge protection (AZURE_KEY_VAULT_PURGE_PROTECTION, openAI mode): on for production; it cannot be turned off again and it stops `azd down --purge` from purging the vault.')
param keyVaultPurgeProtection bool = false

@minValue(7)
@maxValue(90)
@description('Days a deleted Key Vault (and its secret) can be recovered (AZURE_KEY_VAULT_SOFT_DELETE_DAYS). Fixed when the vault is created: an existing vault keeps its own.')
param keyVaultSoftDeleteRetentionDays int = 90

@minValue(1)
@maxValue(1000)
@description('Most instances the app scales out to (AZURE_MAXIMUM_INSTANCE_COUNT; Flex Consumption accepts 1 to 1000): a small cap bounds the cost.')
param maximumInstanceCount int = 100

@allowed([
  512
  2048
  4096
])
@description('Memory of each instance, in MB (AZURE_INSTANCE_MEMORY_MB).')
param instanceMemoryMB int = 2048

// Sized from measurements, not guessed: docs/scaling.md (tools/bench/scaling.py computes it from the
// benchmark figures in docs/benchmarks.md, and tests/test_infra.py checks these defaults against it).
// Flex Consumption runs one Python worker per instance (FUNCTIONS_WORKER_PROCESS_COUNT is not valid
// on that plan), so the instance size buys the host a core, not a second event loop.
@minValue(1)
@maxValue(1000)
@description('Concurrent HTTP invocations (streams) per instance (AZURE_HTTP_PER_INSTANCE_CONCURRENCY); docs/scaling.md derives it from the measured CPU per request and per delta.')
param httpPerInstanceConcurrency int = 121

// Always-ready instances take HTTP requests without a cold start and are billed while idle (the
// baseline rate); 0: every instance is on demand.
@minValue(0)
@maxValue(1000)
@description('Always-ready instances for the HTTP triggers (AZURE_ALWAYS_READY_INSTANCES), billed while idle; 0: none.')
param alwaysReadyInstances int = 0

// How a deployment (code or settings) replaces running instances. Recreate (the default) restarts
// every instance at once: the app drains on SIGTERM (DRAIN_SECONDS) and, with RESUMABLE_STREAMS=on,
// hands each running stream over to the caller's resume. RollingUpdate drains instances in batches;
// Microsoft's site-updates page calls it a preview, not recommended for production apps, with HTTP
// executions limited to 230 s during its drain (docs/production.md, "Deploy again").
@allowed([
  'RollingUpdate'
  'Recreate'
])
@description('functionAppConfig.siteUpdateStrategy (AZURE_SITE_UPDATE_STRATEGY): Recreate replaces every instance at once, RollingUpdate (preview) in batches.')
param siteUpdateStrategy string = 'Recreate'

// Every other setting of the app (README "Settings"): azd's CHAT_APP_SETTINGS, a JSON object, kept in
// .azure/<env>/.env so that every `azd up` writes it again. Secure (here and in the modules it passes
// through), so its values stay out of the deployment history: a pool entry may carry a key. docs/deploy.md ("App settings") says
// what wins when the portal, this object and the template name the same setting.
@secure()
@description('App settings of chatstream/settings.py (CHAT_APP_SETTINGS), name to value, written over the template\'s defaults on every deployment. A list or object value (UPSTREAMS) is written as its JSON. Names the template sets from its own parameters are refused.')
param appSettings object = {}

// The app's own time limits (app settings, see README "Settings"). host.json sets
// "functionTimeout": "00:30:00"; the whole stream must end before it (test_infra checks this).
@minValue(1)
@maxValue(1740)
@description('TOTAL_TIMEOUT_SECONDS: longest stream. Stays below host.json functionTimeout (30 min = 1800 s).')
param totalTimeoutSeconds int = 600

@minValue(1)
@maxValue(1740)
@description('FIRST_TOKEN_TIMEOUT_SECONDS: request sent to first delta.')
param firstTokenTimeoutSeconds int = 120

@minValue(1)
@maxValue(1740)
@description('IDLE_TIMEOUT_SECONDS: longest silence between upstream chunks.')
param idleTimeoutSeconds int = 60

@minValue(1)
@maxValue(200)
@description('HEARTBEAT_SECONDS: keep-alive interval while waiting for the first token; under the 230 s idle cut-off of Azure\'s front end.')
param heartbeatSeconds int = 15

var resourceToken = toLower(uniqueString(subscription().id, environmentName, location))
var tags = {
  'azd-env-name': environmentName
}

// openAI mode against api.openai.com with an empty key would deploy an app that answers every call
// with an upstream auth error: stop the deployment instead, saying what to set. A server of its own
// (OPENAI_BASE_URL) may want no key.
var openAiKeyMissing = upstream == 'openAI' && empty(openAiApiKey) && empty(openAiBaseUrl) && !openAiKeyInVault
var openAiKeyMissingMessage = 'CHAT_UPSTREAM=openAI needs an OpenAI API key: run `azd env set OPENAI_API_KEY <key>` (parameter openAiApiKey), set OPENAI_BASE_URL to a server that wants none, or use CHAT_UPSTREAM=azureOpenAI.'

// A private network without a NAT gateway has no way to api.openai.com.
var noWayOut = vnetEnabled && !natGateway && upstream == 'openAI' && empty(openAiBaseUrl)
var noWayOutMessage = 'VNET_ENABLED=true with CHAT_UPSTREAM=openAI reaches api.openai.com through the virtual network, which then needs its NAT gateway: keep VNET_NAT_GATEWAY=true (the default), or set OPENAI_BASE_URL to a server inside the network.'

resource rg 'Microsoft.Resources/resourceGroups@2024-03-01' = {
  name: 'rg-${environmentName}'
  location: location
  tags: tags
}

module app 'resources.bicep' = {
  name: 'chatstream-resources'
  scope: rg
  params: {
    location: location
    tags: tags
    resourceToken: resourceToken
    upstream: upstream
    modelName: modelName
    modelVersion: modelVersion
    modelVersionUpgradeOption: modelVersionUpgradeOption
    deploymentName: empty(deploymentName) ? modelName : deploymentName
    deploymentSku: deploymentSku
    deploymentCapacity: deploymentCapacity
    openAiLocation: empty(openAiLocation) ? location : openAiLocation
    azureOpenAiApiVersion: azureOpenAiApiVersion
    openAiApiKey: openAiKeyMissing ? fail(openAiKeyMissingMessage) : openAiApiKey
    openAiKeyInVault: openAiKeyInVault
    openAiBaseUrl: openAiBaseUrl
    principalId: principalId
    principalType: principalType
    maximumInstanceCount: maximumInstanceCount
    instanceMemoryMB: instanceMemoryMB
    httpPerInstanceConcurrency: httpPerInstanceConcurrency
    alwaysReadyInstances: alwaysReadyInstances
    totalTimeoutSeconds: totalTimeoutSeconds
    firstTokenTimeoutSeconds: firstTokenTimeoutSeconds
    idleTimeoutSeconds: idleTimeoutSeconds
    heartbeatSeconds: heartbeatSeconds
    vnetEnabled: noWayOut ? fail(noWayOutMessage) : vnetEnabled
    natGateway: natGateway
    siteUpdateStrategy: siteUpdateStrategy
    appSettings: appSettings
    zoneRedundant: zoneRedundant
    keyVaultPurgeProtection: keyVaultPurgeProtection
    keyVaultSoftDeleteRetentionDays: keyVaultSoftDeleteRetentionDays
  }
}

// Names and URLs only: nothing here is a key, a secret or a connection string.
output AZURE_LOCATION string = location
output AZURE_TENANT_ID string = tenant().tenantId
output AZURE_RESOURCE_GROUP string = rg.name
output AZURE_FUNCTION_APP_NAME string = app.outputs.functionAppName
output CHAT_URL string = app.outputs.chatUrl
output CHAT_UPSTREAM string = upstream
output AZURE_OPENAI_ENDPOINT string = app.outputs.azureOpenAiEndpoint
output AZURE_OPENAI_DEPLOYMENT string = app.outputs.azureOpenAiDeployment
output AZURE_KEY_VAULT_NAME string = app.outputs.keyVaultName
output APPLICATIONINSIGHTS_NAME string = app.outputs.applicationInsightsName
output AZURE_MANAGED_IDENTITY_CLIENT_ID string = app.outputs.identityClientId
// The app's own state, for running it locally against Azure (AzureWebJobsStorage__tableServiceUri, __blobServiceUri).
output AZURE_STORAGE_ACCOUNT_NAME string = app.outputs.storageAccountName
output AZURE_STORAGE_TABLE_ENDPOINT string = app.outputs.storageTableEndpoint
output AZURE_STORAGE_BLOB_ENDPOINT string = app.outputs.storageBlobEndpoint
// With VNET_ENABLED and its NAT gateway: the address the app's calls to the internet come from.
output AZURE_OUTBOUND_IP string = app.outputs.outboundIpAddress
