// The chat function app and what it reaches, in one resource group.
//
// One user-assigned managed identity does all the talking: to the storage account (the host's
// state and the deployment package), to Application Insights (Entra-authenticated ingestion), to
// Azure OpenAI (keyless) or to Key Vault (the OpenAI key). The storage account refuses shared keys
// and the Azure OpenAI account refuses API keys, so no account key or key-bearing connection string
// exists anywhere, and none is ever read here.
//
// The same storage account keeps the app's own state: its tables and the stream-log container
// below, reached by the app's clients with the same identity (AzureWebJobsStorage__tableServiceUri
// and __blobServiceUri). With vnetEnabled, storage, Azure OpenAI and Key Vault refuse public
// network access and are reached through private endpoints in a virtual network the app is
// integrated with, and a NAT gateway is its way out to the internet; otherwise they stay public,
// identity-only. Every resource that logs sends its logs and metrics to the Log Analytics workspace.
//
// The app settings are not declared whole on the site: app-settings.bicep writes them from layers
// ("App settings" below), so that a deployment keeps what it does not own.

param location string
param tags object
param resourceToken string

@allowed([
  'azureOpenAI'
  'openAI'
])
param upstream string
param modelName string
param modelVersion string
param modelVersionUpgradeOption string
param deploymentName string
param deploymentSku string
param deploymentCapacity int
param openAiLocation string
param azureOpenAiApiVersion string

@secure()
param openAiApiKey string
param openAiKeyInVault bool
param openAiBaseUrl string
param principalId string
param principalType string
param maximumInstanceCount int
param instanceMemoryMB int
param httpPerInstanceConcurrency int
param alwaysReadyInstances int
param totalTimeoutSeconds int
param firstTokenTimeoutSeconds int
param idleTimeoutSeconds int
param heartbeatSeconds int
param vnetEnabled bool
param natGateway bool
param siteUpdateStrategy string
@secure()
param appSettings object
param zoneRedundant bool
param keyVaultPurgeProtection bool
param keyVaultSoftDeleteRetentionDays int

var useAzureOpenAI = upstream == 'azureOpenAI'
// A key to keep: OpenAI's, or a compatible server's that wants one (a keyless one, e.g. vLLM inside
// the virtual network, gets no vault). The deployment writes the secret only when it is given the
// key; with openAiKeyInVault it is given none and leaves the secret as rotated in the vault.
var useKeyVault = upstream == 'openAI' && (!empty(openAiApiKey) || openAiKeyInVault)
var writeKeySecret = useKeyVault && !empty(openAiApiKey)
var openAiKeySecretName = 'openai-api-key'
var useNatGateway = vnetEnabled && natGateway
var deploymentContainerName = 'app-package'

// The app's own state (the app creates them too where it may, e.g. on Azurite): tables for caller
// keys, rate-limit and budget counters, the usage ledger, response ids and resumable streams, and a
// container for the resumable streams' event logs.
var appTableNames = [
  'chatstreamCallers'
  'chatstreamLimits'
  'chatstreamUsage'
  'chatstreamResponses'
  'chatstreamStreams'
]
var streamsContainerName = 'chatstream-streams'
var deleteRetentionDays = 7
// The app deletes a stream's log RESUME_TTL_SECONDS (at most 7 days) after the stream ends; the
// lifecycle rule below removes what it left behind (a producer that died before its clean-up) a day
// after the longest a log may legitimately live.
var streamLogLifetimeDays = 8

// Private network (vnetEnabled): the app's subnet is delegated to Microsoft.App/environments, as
// Flex Consumption's virtual network integration requires; the private endpoints have their own.
var appSubnetName = 'app'
var privateEndpointSubnetName = 'private-endpoints'

// Built-in role definition ids (the same in every tenant).
var storageBlobDataOwnerRole = 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'
var storageBlobDataContributorRole = 'ba92f5b4-2d11-453d-a403-e96b0029c9fe'
var storageTableDataContributorRole = '0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3'
var monitoringMetricsPublisherRole = '3913510d-42f4-4e42-8a64-420c390055eb'
var cognitiveServicesOpenAIUserRole = '5e0bd9bd-7b93-4f28-af87-19fc36ad61bd'
var keyVaultSecretsUserRole = '4633458b-17de-408a-b874-0445c86b69e6'
var keyVaultSecretsOfficerRole = 'b86a8fe4-44ce-4948-aee5-eccb2c155cd7'

resource identity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: 'id-${resourceToken}'
  location: location
  tags: tags
}

// ---- Monitoring: Log Analytics + workspace-based Application Insights, Entra ingestion only ----

resource logAnalytics 'Microsoft.OperationalInsights/workspaces@2023-09-01' = {
  name: 'log-${resourceToken}'
  location: location
  tags: tags
  properties: {
    sku: {
      name: 'PerGB2018'
    }
    retentionInDays: 30
    features: {
      // Queries and ingestion with Entra tokens only, no workspace keys.
      disableLocalAuth: true
    }
  }
}

resource appInsights 'Microsoft.Insights/components@2020-02-02' = {
  name: 'appi-${resourceToken}'
  location: location
  tags: tags
  kind: 'web'
  properties: {
    Application_Type: 'web'
    WorkspaceResourceId: logAnalytics.id
    // Telemetry is accepted only with an Entra token (APPLICATIONINSIGHTS_AUTHENTICATION_STRING below),
    // so the instrumentation key inside the connection string grants nothing.
    DisableLocalAuth: true
  }
}

resource appInsightsPublisher 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(appInsights.id, identity.id, monitoringMetricsPublisherRole)
  scope: appInsights
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', monitoringMetricsPublisherRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// ---- Storage: host state (AzureWebJobsStorage), the deployment package and the app's own state,
// identity access only ----

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  name: 'st${resourceToken}'
  location: location
  tags: tags
  kind: 'StorageV2'
  sku: {
    // A zone-redundant Flex Consumption plan needs zone-redundant storage for its host state.
    name: zoneRedundant ? 'Standard_ZRS' : 'Standard_LRS'
  }
  properties: {
    allowSharedKeyAccess: false
    defaultToOAuthAuthentication: true
    allowBlobPublicAccess: false
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    publicNetworkAccess: vnetEnabled ? 'Disabled' : 'Enabled'
    networkAcls: {
      defaultAction: vnetEnabled ? 'Deny' : 'Allow'
      bypass: vnetEnabled ? 'None' : 'AzureServices'
    }
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: storage
  name: 'default'
  properties: {
    // A deleted blob or container (a stream log, the package) can be restored for a week.
    deleteRetentionPolicy: {
      enabled: true
      days: deleteRetentionDays
    }
    containerDeleteRetentionPolicy: {
      enabled: true
      days: deleteRetentionDays
    }
  }
}

// Stream logs the app did not delete itself (its instance died first) expire here, so none is kept,
// and billed, for ever.
resource lifecycle 'Microsoft.Storage/storageAccounts/managementPolicies@2023-05-01' = {
  parent: storage
  name: 'default'
  properties: {
    policy: {
      rules: [
        {
          name: 'expire-stream-logs'
          enabled: true
          type: 'Lifecycle'
          definition: {
            filters: {
              blobTypes: [
                'appendBlob'
                'blockBlob'
              ]
              prefixMatch: [
                '${streamsContainerName}/'
              ]
            }
            actions: {
              baseBlob: {
                delete: {
                  daysAfterModificationGreaterThan: streamLogLifetimeDays
                }
              }
            }
          }
        }
      ]
    }
  }
}

resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: deploymentContainerName
  properties: {
    publicAccess: 'None'
  }
}

// The Functions host needs Blob Data Owner on the account (its keys, locks and the package).
resource storageBlobOwner 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(storage.id, identity.id, storageBlobDataOwnerRole)
  scope: storage
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataOwnerRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The app's own state. Each role is scoped to what the app uses: one assignment per table (Azure
// RBAC accepts a single table as scope) and the stream-log container. The app identity's container
// role stays even though the host's account-wide Blob Data Owner covers it today, so narrowing the
// host's role later does not cut the app off.
resource streamsContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: streamsContainerName
  properties: {
    publicAccess: 'None'
  }
}

resource tableService 'Microsoft.Storage/storageAccounts/tableServices@2023-05-01' = {
  parent: storage
  name: 'default'
}

resource appTables 'Microsoft.Storage/storageAccounts/tableServices/tables@2023-05-01' = [for tableName in appTableNames: {
  parent: tableService
  name: tableName
}]

resource appTableContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for i in range(0, length(appTableNames)): {
  name: guid(appTables[i].id, identity.id, storageTableDataContributorRole)
  scope: appTables[i]
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageTableDataContributorRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}]

resource streamsContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(streamsContainer.id, identity.id, storageBlobDataContributorRole)
  scope: streamsContainer
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataContributorRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The person or pipeline running azd gets the same access, to run the app locally against these
// tables and container (from outside the virtual network only while vnetEnabled is off).
resource appTableContributorForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for i in range(0, length(appTableNames)): if (!empty(principalId)) {
  name: guid(appTables[i].id, principalId, storageTableDataContributorRole)
  scope: appTables[i]
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageTableDataContributorRole)
    principalId: principalId
    principalType: principalType
  }
}]

resource streamsContributorForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (!empty(principalId)) {
  name: guid(streamsContainer.id, principalId, storageBlobDataContributorRole)
  scope: streamsContainer
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataContributorRole)
    principalId: principalId
    principalType: principalType
  }
}

// ---- Upstream, mode azureOpenAI: an Azure OpenAI account that accepts Entra tokens only ----

resource openAi 'Microsoft.CognitiveServices/accounts@2024-10-01' = if (useAzureOpenAI) {
  name: 'oai-${resourceToken}'
  location: openAiLocation
  tags: tags
  kind: 'OpenAI'
  sku: {
    name: 'S0'
  }
  properties: {
    customSubDomainName: 'oai-${resourceToken}'
    publicNetworkAccess: vnetEnabled ? 'Disabled' : 'Enabled'
    networkAcls: {
      defaultAction: vnetEnabled ? 'Deny' : 'Allow'
    }
    disableLocalAuth: true
    // The account itself calls out nowhere (no data sources, no web fetches).
    restrictOutboundNetworkAccess: true
    allowedFqdnList: []
  }
}

resource modelDeployment 'Microsoft.CognitiveServices/accounts/deployments@2024-10-01' = if (useAzureOpenAI) {
  parent: openAi
  name: deploymentName
  sku: {
    name: deploymentSku
    capacity: deploymentCapacity
  }
  properties: {
    model: {
      format: 'OpenAI'
      name: modelName
      version: modelVersion
    }
    versionUpgradeOption: modelVersionUpgradeOption
  }
}

resource openAiUser 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useAzureOpenAI) {
  name: guid(resourceGroup().id, 'oai-${resourceToken}', identity.id, cognitiveServicesOpenAIUserRole)
  scope: openAi
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', cognitiveServicesOpenAIUserRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The person running azd may call the model too (e.g. the app run locally against it).
resource openAiUserForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useAzureOpenAI && !empty(principalId)) {
  name: guid(resourceGroup().id, 'oai-${resourceToken}', principalId, cognitiveServicesOpenAIUserRole)
  scope: openAi
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', cognitiveServicesOpenAIUserRole)
    principalId: principalId
    principalType: principalType
  }
}

// ---- Upstream, mode openAI: the API key as a Key Vault secret, read by the platform ----

resource keyVault 'Microsoft.KeyVault/vaults@2023-07-01' = if (useKeyVault) {
  name: 'kv-${resourceToken}'
  location: location
  tags: tags
  properties: {
    tenantId: subscription().tenantId
    sku: {
      family: 'A'
      name: 'standard'
    }
    enableRbacAuthorization: true
    enableSoftDelete: true
    softDeleteRetentionInDays: keyVaultSoftDeleteRetentionDays
    // Purge protection cannot be turned off once on, and it blocks `azd down --purge`; the property
    // only accepts true, so it is left out (null) when off.
    enablePurgeProtection: keyVaultPurgeProtection ? true : null
    publicNetworkAccess: vnetEnabled ? 'Disabled' : 'Enabled'
    networkAcls: {
      defaultAction: vnetEnabled ? 'Deny' : 'Allow'
      bypass: 'AzureServices'
    }
  }
}

resource openAiKeySecret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' = if (writeKeySecret) {
  parent: keyVault
  name: openAiKeySecretName
  properties: {
    value: openAiApiKey
    contentType: 'OpenAI API key'
  }
}

resource keyVaultSecretsUser 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useKeyVault) {
  name: guid(resourceGroup().id, 'kv-${resourceToken}', identity.id, keyVaultSecretsUserRole)
  scope: keyVault
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', keyVaultSecretsUserRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The person running azd may replace the key later (az keyvault secret set).
resource keyVaultOfficerForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useKeyVault && !empty(principalId)) {
  name: guid(resourceGroup().id, 'kv-${resourceToken}', principalId, keyVaultSecretsOfficerRole)
  scope: keyVault
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', keyVaultSecretsOfficerRole)
    principalId: principalId
    principalType: principalType
  }
}

// ---- Private network (vnetEnabled): the app's subnet, its NAT gateway, private endpoints and
// private DNS zones ----

// The app subnet's way out to the internet (api.openai.com in openAI mode, Application Insights
// ingestion in both), from one static address. Its idle timeout outlasts the app's longest silence
// on an upstream connection (the first-token and idle limits), so a slow first token is not cut.
resource natPublicIp 'Microsoft.Network/publicIPAddresses@2024-05-01' = if (useNatGateway) {
  name: 'pip-nat-${resourceToken}'
  location: location
  tags: tags
  sku: {
    name: 'Standard'
  }
  properties: {
    publicIPAllocationMethod: 'Static'
    publicIPAddressVersion: 'IPv4'
  }
}

resource nat 'Microsoft.Network/natGateways@2024-05-01' = if (useNatGateway) {
  name: 'nat-${resourceToken}'
  location: location
  tags: tags
  sku: {
    name: 'Standard'
  }
  properties: {
    idleTimeoutInMinutes: max(4, (max(firstTokenTimeoutSeconds, idleTimeoutSeconds) + 59) / 60)
    publicIpAddresses: [
      {
        id: natPublicIp.id
      }
    ]
  }
}

resource vnet 'Microsoft.Network/virtualNetworks@2024-05-01' = if (vnetEnabled) {
  name: 'vnet-${resourceToken}'
  location: location
  tags: tags
  properties: {
    addressSpace: {
      addressPrefixes: [
        '10.0.0.0/16'
      ]
    }
    subnets: [
      {
        // Room for maximumInstanceCount's ceiling (1,000) should each instance take an address.
        name: appSubnetName
        properties: {
          addressPrefix: '10.0.0.0/22'
          natGateway: useNatGateway ? {
            id: nat.id
          } : null
          delegations: [
            {
              name: 'flex-consumption'
              properties: {
                serviceName: 'Microsoft.App/environments'
              }
            }
          ]
        }
      }
      {
        name: privateEndpointSubnetName
        properties: {
          addressPrefix: '10.0.4.0/24'
          privateEndpointNetworkPolicies: 'Disabled'
        }
      }
    ]
  }
}

var appSubnetId = vnetEnabled ? '${vnet.id}/subnets/${appSubnetName}' : ''
var privateEndpointSubnetId = vnetEnabled ? '${vnet.id}/subnets/${privateEndpointSubnetName}' : ''

module storageBlobPrivateLink 'private-link.bicep' = if (vnetEnabled) {
  name: 'private-link-blob'
  params: {
    name: 'pe-blob-${resourceToken}'
    location: location
    tags: tags
    virtualNetworkId: vnet.id
    subnetId: privateEndpointSubnetId
    targetId: storage.id
    groupId: 'blob'
    zoneName: 'privatelink.blob.${environment().suffixes.storage}'
  }
}

// No queue endpoint: nothing here uses queues (HTTP triggers only; the host's state is in blobs).
module storageTablePrivateLink 'private-link.bicep' = if (vnetEnabled) {
  name: 'private-link-table'
  params: {
    name: 'pe-table-${resourceToken}'
    location: location
    tags: tags
    virtualNetworkId: vnet.id
    subnetId: privateEndpointSubnetId
    targetId: storage.id
    groupId: 'table'
    zoneName: 'privatelink.table.${environment().suffixes.storage}'
  }
}

module openAiPrivateLink 'private-link.bicep' = if (vnetEnabled && useAzureOpenAI) {
  name: 'private-link-openai'
  params: {
    name: 'pe-oai-${resourceToken}'
    location: location
    tags: tags
    virtualNetworkId: vnet.id
    subnetId: privateEndpointSubnetId
    targetId: openAi.id
    groupId: 'account'
    zoneName: 'privatelink.openai.azure.com'
  }
}

module keyVaultPrivateLink 'private-link.bicep' = if (vnetEnabled && useKeyVault) {
  name: 'private-link-vault'
  params: {
    name: 'pe-kv-${resourceToken}'
    location: location
    tags: tags
    virtualNetworkId: vnet.id
    subnetId: privateEndpointSubnetId
    targetId: keyVault.id
    groupId: 'vault'
    zoneName: 'privatelink.vaultcore.azure.net'
  }
}

// ---- App settings ----
//
// Four layers, lowest first, written as the site's one `appsettings` resource on every deployment
// (app-settings.bicep):
//   1. templateDefaults: the template's choices for settings an operator may change;
//   2. the settings the site has now (the portal's edits included): they win over the defaults, so
//      a value set by hand stays;
//   3. appSettings (azd CHAT_APP_SETTINGS): wins over the portal, and is written again by every
//      `azd up`;
//   4. templateSettings: what the template derives from the resources it creates and from its own
//      parameters (identity, storage, telemetry, the upstream, the time limits); a deployment always
//      writes these, and refuses them in appSettings, naming them.
// A setting none of the layers names is kept as it is: a deployment never removes one (delete it
// with `az functionapp config appsettings delete`).

var templateDefaults = {
  // Keep every span: azure-monitor-opentelemetry otherwise samples traces at 5 per second, and each
  // stream is one chat.stream span (docs/observability.md).
  OTEL_TRACES_SAMPLER: 'always_on'
  // The host writes its diagnostic events to a table it creates in AzureWebJobsStorage, named by the
  // month. A role for it would have to be account-wide, wider than the per-table roles the identity
  // has; without one every write is a 403 in the logs. Off: the portal's diagnostic-events view stays
  // empty, the host's own logs still reach Application Insights and Log Analytics.
  AzureWebJobsFeatureFlags: 'DisableDiagnosticEventLogging'
  // How long the Functions host lets requests run after SIGTERM (a restart, a Recreate deploy):
  // ASP.NET Core's default is 5 s, which cuts the app's drain (DRAIN_SECONDS, 20 s) to 3.5 s.
  // Not verified on Azure that the platform waits this long before it kills the container.
  ASPNETCORE_SHUTDOWNTIMEOUTSECONDS: '25'
  UPSTREAM_CONNECT_TIMEOUT_SECONDS: '10'
  USAGE_WAIT_SECONDS: '2'
  UPSTREAM_MAX_RETRIES: '2'
  // The output cap a request that names none is sent with, and reserves, under CALLER_KEYS=required:
  // with the deployment's capacity it sets how many requests a minute the model admits (main.bicep).
  DEFAULT_MAX_OUTPUT_TOKENS: '4096'
  MAX_BODY_BYTES: '1048576'
  // The browser playground (GET /api/playground) and the operators' console (GET /api/console) stay
  // off in Azure; 'true' serves them (docs/playground.md). Every API call they make still needs a key.
  PLAYGROUND_ENABLED: 'false'
  CONSOLE_ENABLED: 'false'
}

// The upstream settings of both modes are written in both, the unused ones empty (the app reads an
// empty setting as unset): switching CHAT_UPSTREAM leaves nothing of the other mode behind. The
// OpenAI key is a Key Vault reference: the platform resolves it with keyVaultReferenceIdentity, and
// neither this template nor the site configuration ever holds the key itself. No Azure OpenAI key:
// the account takes Entra tokens only.
var templateSettings = {
  // The host reaches storage and Application Insights with the identity; AZURE_CLIENT_ID makes
  // DefaultAzureCredential in the app pick that same identity.
  AzureWebJobsStorage__accountName: storage.name
  AzureWebJobsStorage__credential: 'managedidentity'
  AzureWebJobsStorage__clientId: identity.properties.clientId
  // The app's own clients (azure-data-tables, azure-storage-blob) read these two with the credential
  // and client id above; they end with '/'.
  AzureWebJobsStorage__tableServiceUri: storage.properties.primaryEndpoints.table
  AzureWebJobsStorage__blobServiceUri: storage.properties.primaryEndpoints.blob
  APPLICATIONINSIGHTS_CONNECTION_STRING: appInsights.properties.ConnectionString
  APPLICATIONINSIGHTS_AUTHENTICATION_STRING: 'ClientId=${identity.properties.clientId};Authorization=AAD'
  // The Python worker configures azure-monitor-opentelemetry itself (host.json telemetryMode
  // OpenTelemetry); chatstream/telemetry.py then only adds its spans and metrics.
  PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY: 'true'
  AZURE_CLIENT_ID: identity.properties.clientId
  OPENAI_MODEL: useAzureOpenAI ? deploymentName : modelName
  AZURE_OPENAI_ENDPOINT: useAzureOpenAI ? openAi.properties.endpoint : ''
  AZURE_OPENAI_DEPLOYMENT: useAzureOpenAI ? deploymentName : ''
  AZURE_OPENAI_API_VERSION: useAzureOpenAI ? azureOpenAiApiVersion : ''
  AZURE_OPENAI_API_KEY: ''
  // Versionless: the platform reads the secret's latest version, so a rotation in the vault reaches the
  // app (within a day, or at its next restart) without a deployment.
  OPENAI_API_KEY: useKeyVault ? '@Microsoft.KeyVault(SecretUri=${keyVault.properties.vaultUri}secrets/${openAiKeySecretName})' : ''
  OPENAI_BASE_URL: useAzureOpenAI ? '' : openAiBaseUrl
  FIRST_TOKEN_TIMEOUT_SECONDS: string(firstTokenTimeoutSeconds)
  IDLE_TIMEOUT_SECONDS: string(idleTimeoutSeconds)
  TOTAL_TIMEOUT_SECONDS: string(totalTimeoutSeconds)
  HEARTBEAT_SECONDS: string(heartbeatSeconds)
}

// An operator's setting the template owns would be overwritten by layer 4 on this and every later
// deployment: refuse it, naming it, rather than drop it silently.
var refusedSettings = intersection(objectKeys(appSettings), objectKeys(templateSettings))
var refusedMessage = 'CHAT_APP_SETTINGS sets ${join(refusedSettings, ', ')}, which the template sets itself from its own parameters and resources: leave them out (docs/deploy.md, "App settings", says which azd value sets each).'
// Values are written as text: a list or an object (UPSTREAMS) as its JSON.
var operatorSettings = empty(refusedSettings) ? mapValues(appSettings, value => string(value)) : fail(refusedMessage)

// ---- The function app: Flex Consumption, Python 3.13 ----

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  name: 'plan-${resourceToken}'
  location: location
  tags: tags
  kind: 'functionapp'
  sku: {
    name: 'FC1'
    tier: 'FlexConsumption'
  }
  properties: {
    reserved: true
    // Zone redundancy: the platform keeps at least two always-ready instances (billed as such).
    zoneRedundant: zoneRedundant
  }
}

resource functionApp 'Microsoft.Web/sites@2024-11-01' = {
  name: 'func-${resourceToken}'
  location: location
  tags: union(tags, {
    'azd-service-name': 'api'
  })
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identity.id}': {}
    }
  }
  properties: {
    serverFarmId: plan.id
    httpsOnly: true
    keyVaultReferenceIdentity: identity.id
    // Flex Consumption sends the app's outbound traffic through the integrated subnet; allTraffic
    // routes the platform's own calls for the app through it too, among them the resolution of Key
    // Vault references at start-up, which a vault reachable only by its private endpoint needs.
    virtualNetworkSubnetId: vnetEnabled ? appSubnetId : null
    outboundVnetRouting: vnetEnabled ? {
      allTraffic: true
    } : null
    siteConfig: {
      minTlsVersion: '1.2'
      scmMinTlsVersion: '1.2'
    }
    functionAppConfig: {
      deployment: {
        storage: {
          type: 'blobContainer'
          value: '${storage.properties.primaryEndpoints.blob}${deploymentContainerName}'
          authentication: {
            type: 'UserAssignedIdentity'
            userAssignedIdentityResourceId: identity.id
          }
        }
      }
      scaleAndConcurrency: {
        maximumInstanceCount: maximumInstanceCount
        instanceMemoryMB: instanceMemoryMB
        triggers: {
          http: {
            perInstanceConcurrency: httpPerInstanceConcurrency
          }
        }
        // The group 'http' covers every HTTP-triggered function (the app's only trigger).
        alwaysReady: alwaysReadyInstances > 0 ? [
          {
            name: 'http'
            instanceCount: alwaysReadyInstances
          }
        ] : []
      }
      runtime: {
        name: 'python'
        version: '3.13'
      }
      siteUpdateStrategy: {
        type: siteUpdateStrategy
      }
    }
  }
  // The host must be able to reach its storage and its upstream when it first starts, and the app
  // its own state (role assignments can still take minutes to apply after this).
  dependsOn: [
    storageBlobOwner
    appTableContributor
    streamsContributor
    appInsightsPublisher
    openAiUser
    keyVaultSecretsUser
    deploymentContainer
    storageBlobPrivateLink
    storageTablePrivateLink
    openAiPrivateLink
    keyVaultPrivateLink
  ]
}

module siteAppSettings 'app-settings.bicep' = {
  name: 'app-settings'
  params: {
    appName: functionApp.name
    // Read when this module runs, after the site exists (the pattern of the Azure Verified Modules'
    // web/site, retainCurrentAppSettings).
    currentAppSettings: list('${functionApp.id}/config/appsettings', '2024-11-01').properties
    templateDefaults: templateDefaults
    operatorSettings: operatorSettings
    templateSettings: templateSettings
  }
  // The settings name the secret by its URI: it is written first.
  dependsOn: [
    openAiKeySecret
  ]
}

// No basic-auth publishing: deployments (azd, Core Tools) use Entra tokens. (siteConfig.ftpsState is
// not set: Flex Consumption does not support FTPS and lists the property as deprecated.)
resource ftpBasicAuth 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: functionApp
  name: 'ftp'
  properties: {
    allow: false
  }
}

resource scmBasicAuth 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: functionApp
  name: 'scm'
  properties: {
    allow: false
  }
}

// ---- Diagnostic settings: resource logs and metrics to the Log Analytics workspace ----

resource functionAppDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = {
  name: 'to-log-analytics'
  scope: functionApp
  properties: {
    workspaceId: logAnalytics.id
    logs: [
      {
        category: 'FunctionAppLogs'
        enabled: true
      }
    ]
    metrics: [
      {
        category: 'AllMetrics'
        enabled: true
      }
    ]
  }
}

// The account itself has metrics only; its logs are per service. Writes and deletes are logged
// (who changed which table entity or blob); reads, by far the most records, are not (add
// 'StorageRead' to investigate access).
resource storageDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = {
  name: 'to-log-analytics'
  scope: storage
  properties: {
    workspaceId: logAnalytics.id
    metrics: [
      {
        category: 'Transaction'
        enabled: true
      }
    ]
  }
}

resource blobDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = {
  name: 'to-log-analytics'
  scope: blobService
  properties: {
    workspaceId: logAnalytics.id
    logs: [
      {
        category: 'StorageWrite'
        enabled: true
      }
      {
        category: 'StorageDelete'
        enabled: true
      }
    ]
    metrics: [
      {
        category: 'Transaction'
        enabled: true
      }
    ]
  }
}

resource tableDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = {
  name: 'to-log-analytics'
  scope: tableService
  properties: {
    workspaceId: logAnalytics.id
    logs: [
      {
        category: 'StorageWrite'
        enabled: true
      }
      {
        category: 'StorageDelete'
        enabled: true
      }
    ]
    metrics: [
      {
        category: 'Transaction'
        enabled: true
      }
    ]
  }
}

resource openAiDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = if (useAzureOpenAI) {
  name: 'to-log-analytics'
  scope: openAi
  properties: {
    workspaceId: logAnalytics.id
    logs: [
      {
        categoryGroup: 'allLogs'
        enabled: true
      }
    ]
    metrics: [
      {
        category: 'AllMetrics'
        enabled: true
      }
    ]
  }
}

resource keyVaultDiagnostics 'Microsoft.Insights/diagnosticSettings@2021-05-01-preview' = if (useKeyVault) {
  name: 'to-log-analytics'
  scope: keyVault
  properties: {
    workspaceId: logAnalytics.id
    logs: [
      {
        categoryGroup: 'allLogs'
        enabled: true
      }
    ]
    metrics: [
      {
        category: 'AllMetrics'
        enabled: true
      }
    ]
  }
}

output functionAppName string = functionApp.name
output chatUrl string = 'https://${functionApp.properties.defaultHostName}/api/chat'
output azureOpenAiEndpoint string = useAzureOpenAI ? openAi.properties.endpoint : ''
output azureOpenAiDeployment string = useAzureOpenAI ? deploymentName : ''
output keyVaultName string = useKeyVault ? keyVault.name : ''
output applicationInsightsName string = appInsights.name
output identityClientId string = identity.properties.clientId
output storageAccountName string = storage.name
output storageTableEndpoint string = storage.properties.primaryEndpoints.table
output storageBlobEndpoint string = storage.properties.primaryEndpoints.blob
// With the NAT gateway: the one address the app's outbound calls come from (for an upstream's allow list).
output outboundIpAddress string = useNatGateway ? natPublicIp.properties.ipAddress : ''
